"""Evaluation: greedy episodes over a dataset, scored for correctness and calibration.

    summary = evaluate(model, tokenizer, examples, mode="search", tools={"search": retriever},
                       out_dir="runs/eval-search")

Modes (prompt template, action protocol, tool):
    search  CAR search prompt, `car_search()` (Search-R1 tags, answer runs on to </confidence>),
            tool "search"
    direct  no-tool prompt, the same protocol with `max_turns=0`: one segment, no tool
    tir     TIR prompt, `TIR()` protocol, tool "code" (the Python sandbox); math examples only
    mixed   mixed prompt, `Mixed()` protocol, both tools ("search" and "code") in one episode;
            QA and math examples alike (world-large mixed_train / mixed_dev)
Scoring (`car_jax.calibration.rewards.reward_inputs`, with each example's task): "qa" = exact match of the
last <answer>, format = the full tag chain; "math" = math-verify on the last <answer> or
\\boxed{}, format = the confidence parses. A missing confidence counts as q = 0.

Files written to `out_dir`:
    samples.jsonl    one line per example, appended as each batch finishes (fsync'd), so a
                     crash loses at most the batch in flight; `resume=True` skips ids already
                     there (a torn last line from a crash is cut off first)
    summary.json     metrics (`car_jax.calibration.metrics.calibration`) over all examples, percentile
                     bootstrap 95% intervals, mean turns / tool calls, format-valid rate,
                     per-kind breakdown; NaN (undefined AUROC / MCIP) is written as null
    reliability.png  reliability diagram

A batch's episodes run in the episode engine (`car_jax.rollout.engine`), as training's do:
at most `episode.max_concurrent` of them at once (0: the whole batch), tools overlapping
decoding; `summary.json`'s run section has its slot utilisation.

On a mesh (a model loaded with one) a batch's rows are split over the mesh axis `fsdp`: a
short batch is padded with copies of its last example to a multiple of fsdp, and the
padded rows' results are dropped. With several processes (`jax.distributed`) every process
calls `evaluate` with the same arguments; each runs the episodes and tools of its block of
every batch (`hosts.local_rows`), the records are gathered so every process holds all of
them in batch order, only process 0 writes the files, and every process returns the same
summary. `resume=True` then needs out_dir on a filesystem every process sees.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from car_jax import hosts
from car_jax.calibration import metrics, parsing, pieces
from car_jax.calibration.plots import reliability_diagram
from car_jax.calibration.rewards import reward_inputs
from car_jax.data.examples import QAExample
from car_jax.data.prompts import make_prompt
from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
from car_jax.rollout.protocols import TIR, Mixed, car_search
from car_jax.rollout.toolbox import tool_names

SAMPLES_FILE, SUMMARY_FILE, PLOT_FILE = "samples.jsonl", "summary.json", "reliability.png"
# greedy decoding (Search-R1's validation), 4 search turns of 500 tokens, 500-token observations
EVAL_EPISODE = EpisodeConfig(max_turns=4, max_response_tokens=500, max_obs_tokens=500, temperature=0.0, top_p=1.0)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How one evaluation mode prompts and acts: template name, protocol factory, tool kind."""

    name: str
    template: str
    protocol: Callable[[], object]
    tool: str | None  # the tool kind the mode calls (`toolbox.tool_names`), None for no tool
    single_turn: bool = False


MODES = {
    "search": Mode("search", "search", car_search, "search"),
    "direct": Mode("direct", "direct", car_search, None, single_turn=True),
    "tir": Mode("tir", "tir", TIR, "code"),
    "mixed": Mode("mixed", "mixed", Mixed, "mixed"),
}


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown eval mode {name!r}; choose one of {sorted(MODES)}")
    return MODES[name]


# ---------------------------------------------------------------- scoring
def score(examples: Sequence[QAExample], responses: Sequence[pieces.Response], mode: str) -> list[dict]:
    """Responses (an episode's pieces, or response texts) -> one sample record per example
    (no episode stats). Answers and confidences come from the model's own text only
    (`car_jax.calibration.pieces`); `response` is the whole text, tools' pieces included.

    Record: id, question, golden_answers, data_source, mode, response, answer (None when the
    response has none), confidence (q in [0, 1], 0 when missing), confidence_ok, correct (bool),
    format_ok (bool), format_reason, plus `kind` / `answerable` when the example's meta has them.
    """
    out = []
    for ex, response in zip(examples, responses, strict=True):
        inputs = reward_inputs([response], [list(ex.golden_answers)], task=ex.task)
        parsed = pieces.parse_pieces(response)
        text = response if isinstance(response, str) else "".join(t for t, _ in response)
        answer = parsed.answer
        if ex.task == "math":
            answer = answer if answer is not None else parsing.last_boxed(pieces.boxed_source(response))
            reason = "" if parsed.confidence_ok else "confidence missing or not a number in [0, 100]"
        else:
            reason = parsed.reason
        rec = {"id": ex.id, "question": ex.question, "golden_answers": list(ex.golden_answers),
               "data_source": ex.data_source, "mode": mode, "response": text, "answer": answer,
               "confidence": float(parsed.q), "confidence_ok": bool(parsed.confidence_ok),
               "correct": bool(inputs.correct[0]), "format_ok": bool(inputs.format_ok[0]),
               "format_reason": reason}
        rec.update({k: ex.meta[k] for k in ("kind", "answerable") if k in ex.meta})
        out.append(rec)
    return out


# ---------------------------------------------------------------- samples file
def read_samples(path: str | Path, repair: bool = False, missing_ok: bool = False) -> list[dict]:
    """The records of a samples.jsonl. A torn last line (no newline, not JSON: a crash while
    writing) is skipped, and cut from the file when `repair`; a bad line elsewhere raises.
    A missing file raises, unless `missing_ok` (then there are no records yet)."""
    path = Path(path)
    if not path.is_file():
        if missing_ok:
            return []
        raise FileNotFoundError(f"no samples file at {path}: `car-jax eval` writes <out>/samples.jsonl")
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows, good_end = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            good_end += len(line) + 1
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the last line, without its newline: torn
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; fix or remove it before resuming") from None
        good_end += len(line) + 1
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def _done_records(path: Path, resume: bool) -> list[dict]:
    """The records already in samples.jsonl when resuming ([] otherwise): process 0 cuts a
    torn last line first, then every process reads the same file."""
    if not resume:
        return []
    rows = read_samples(path, repair=True, missing_ok=True) if hosts.is_writer() else None
    hosts.sync("eval: samples.jsonl repaired")
    rows = rows if rows is not None else read_samples(path, missing_ok=True)
    counts = hosts.allgather(np.array([len(rows)]))
    if len(set(counts.tolist())) > 1:
        raise ValueError(f"{path}: the processes read {counts.tolist()} records from it; output.dir must be "
                         "a folder every process sees (a shared filesystem) to resume")
    return rows


def _append(path: Path, records: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- summary
def _num(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def summarize(samples: Sequence[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """Sample records -> the summary dict (metric names of `car_jax.calibration.metrics.KEYS` at top level)."""
    c = np.array([s["correct"] for s in samples], bool)
    q = np.array([s["confidence"] for s in samples], np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = metrics.calibration(c, q)
        ci = metrics.bootstrap_ci(c, q, n_boot=n_boot, seed=seed) if n_boot else {}
    out = {k: _num(v) for k, v in m.items()}
    out["ci95"] = {k: [_num(lo), _num(hi)] for k, (lo, hi) in ci.items()}
    for key, field in (("mean_turns", "n_turns"), ("mean_tool_calls", "n_tool_calls"),
                       ("format_rate", "format_ok"), ("confidence_rate", "confidence_ok"),
                       ("answered_rate", "answered")):
        vals = [float(s[field]) for s in samples if field in s]
        out[key] = float(np.mean(vals)) if vals else None
    kinds = sorted({s["kind"] for s in samples if "kind" in s})
    out["by_kind"] = {k: _subset([s for s in samples if s.get("kind") == k]) for k in kinds}
    out["warnings"] = sorted({str(w.message) for w in caught})
    return out


def _subset(rows: list[dict]) -> dict:
    return {"n": len(rows), "accuracy": float(np.mean([r["correct"] for r in rows])),
            "mean_confidence": float(np.mean([r["confidence"] for r in rows])),
            "format_rate": float(np.mean([r["format_ok"] for r in rows]))}


def format_table(summary: dict) -> str:
    """A short text table of the main numbers with their 95% intervals."""
    def cell(key):
        v, ci = summary.get(key), summary.get("ci95", {}).get(key)
        if v is None:
            return "n/a"
        return f"{v:.3f}" + (f"  [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci else "")

    rows = [("examples", str(summary["n"])), ("accuracy", cell("accuracy")), ("ECE", cell("ece")),
            ("MCIP", cell("mcip")), ("AUROC", cell("auroc")), ("Brier", cell("brier")),
            ("mean confidence", cell("mean_confidence"))]
    for key, label in (("format_rate", "format valid"), ("mean_turns", "mean turns"),
                       ("mean_tool_calls", "mean tool calls")):
        if summary.get(key) is not None:
            rows.append((label, f"{summary[key]:.3f}"))
    for kind, sub in summary.get("by_kind", {}).items():
        rows.append((f"  {kind} (n={sub['n']})", f"acc {sub['accuracy']:.3f}, mean q {sub['mean_confidence']:.3f}"))
    width = max(len(r[0]) for r in rows)
    head = f"mode {summary.get('mode', '?')}  (95% bootstrap intervals)"
    return "\n".join([head] + [f"{k.ljust(width)}  {v}" for k, v in rows])


COMPARE_ROWS = (("accuracy", "accuracy"), ("ECE", "ece"), ("MCIP", "mcip"), ("AUROC", "auroc"),
                ("Brier", "brier"), ("mean confidence", "mean_confidence"), ("format valid", "format_rate"),
                ("mean tool calls", "mean_tool_calls"))


def compare_table(summaries: dict[str, dict]) -> str:
    """One text table with a column per summary ({column label: summary}), a row per metric
    (accuracy, ECE, MCIP, AUROC, Brier, mean confidence, format valid, mean tool calls), and
    the last column minus the first. Undefined values (AUROC of a one-class set) print n/a."""
    labels = list(summaries)

    def value(summary, key):
        v = summary.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    head = ["metric", *labels] + (["change"] if len(labels) > 1 else [])
    body = []
    for name, key in COMPARE_ROWS:
        vals = [value(summaries[label], key) for label in labels]
        cells = ["n/a" if v is None else f"{v:.3f}" for v in vals]
        if len(labels) > 1:
            first, last = vals[0], vals[-1]
            cells.append("n/a" if first is None or last is None else f"{last - first:+.3f}")
        body.append([name, *cells])
    body.append(["examples", *(str(summaries[label]["n"]) for label in labels)] + ([""] if len(labels) > 1 else []))
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


# ---------------------------------------------------------------- the loop
def _run_batch(run: Callable, batch: list[QAExample], template: str, mode: str, mesh) -> tuple[list[dict], int]:
    """One batch's episodes (`run(prompts)`: run_episodes with the loop's settings) ->
    (its sample records in batch order, in every process; tokens the model sampled for
    them). On a mesh the rows are padded with copies of the last example to a multiple
    of fsdp and each process runs its block of them; padded rows' results are dropped."""
    rows = batch + [batch[-1]] * (-len(batch) % (1 if mesh is None else mesh.shape["fsdp"]))
    mine = hosts.local_rows(len(rows), mesh)
    trajs = run([make_prompt(e, template) for e in rows[mine]])
    real = max(0, min(mine.stop, len(batch)) - mine.start)  # this process's rows that are not padding
    trajs = trajs[:real]
    records = score(batch[mine.start:mine.start + real], [t.pieces for t in trajs], mode)
    for rec, t in zip(records, trajs):
        rec.update(n_turns=t.n_turns, n_tool_calls=t.n_tool_calls, answered=t.answered,
                   tool_requests=[log["request"] for log in t.tool_log])
    parts = hosts.allgather_objects({"start": mine.start, "records": records,
                                     "sampled": sum(int(t.loss_mask.sum()) for t in trajs)})
    parts.sort(key=lambda p: p["start"])
    return [r for p in parts for r in p["records"]], sum(p["sampled"] for p in parts)


def evaluate(model, tokenizer, examples: Sequence[QAExample], *, mode: str = "search",
             tools: dict | None = None, episode_config: EpisodeConfig = EVAL_EPISODE,
             out_dir: str | Path, batch_size: int = 8, resume: bool = False, n_boot: int = 1000,
             seed: int = 0, progress: bool = True, info: dict | None = None) -> dict:
    """Runs `mode` on every example, writes samples.jsonl / summary.json / reliability.png to
    `out_dir`, returns the summary dict.

    tools: action kind -> batched tool ({"search": retriever} / {"code": PythonTool()}); the
    mode's tool must be there (direct mode needs none). `episode_config` is used as given
    (default greedy, 4 turns, 500 tokens per turn); direct mode forces `max_turns=0`.
    resume=False refuses to write into a folder that already has samples (pass resume=True
    to continue it, or another out_dir). `info` (model, dataset, ...) is copied into the summary.
    """
    spec = get_mode(mode)
    examples = list(examples)
    if not examples:
        raise ValueError("evaluate needs at least one example")
    tools = dict(tools or {})
    if missing := [name for name in tool_names(spec.tool) if name not in tools]:
        raise ValueError(f"mode {mode!r} needs a {missing[0]!r} tool in tools=, got {sorted(tools)}")
    if mode == "tir" and (bad := [e.id for e in examples if e.task != "math"]):
        raise ValueError(f"mode 'tir' scores math answers, but {len(bad)} examples are QA (e.g. {bad[0]!r}); "
                         "use a math dataset (MATH-500: problem, answer; AIME 2024: Problem, Answer) "
                         "or mode 'search'/'direct'")
    config = dataclasses.replace(episode_config, max_turns=0) if spec.single_turn else episode_config
    mesh = None if model is None else model.mesh  # None: no model (tests script run_episodes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES_FILE
    done_rows = _done_records(path, resume)
    if not resume and path.is_file() and path.stat().st_size:
        raise FileExistsError(f"{path} already holds samples; pass resume=True (--resume) to continue "
                              "that run, or choose another out_dir")
    other = {r.get("mode") for r in done_rows} - {mode}
    if other:
        raise ValueError(f"{path} holds samples of mode {sorted(other)}, not {mode!r}; use another out_dir")
    done = {r["id"] for r in done_rows}
    todo = [e for e in examples if e.id not in done]

    stats, t0, sampled = EpisodeStats(), time.perf_counter(), 0
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=f"eval {mode}", unit="q",
               disable=not progress or not hosts.is_writer())
    wanted = {e.id for e in examples}
    by_id = {r["id"]: r for r in done_rows}  # the summary's records, kept here (not re-read from the file)
    n_seen = len(examples) - len(todo)
    n_right = sum(r["correct"] for r in done_rows if r["id"] in wanted)
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        run = functools.partial(run_episodes, model, tokenizer, tools=tools, config=config, protocol=spec.protocol(),
                                seed=seed + start, stats=stats)
        records, n_sampled = _run_batch(run, batch, spec.template, mode, mesh)
        if hosts.is_writer():
            _append(path, records)
        by_id.update((r["id"], r) for r in records)
        sampled += n_sampled
        n_right += sum(r["correct"] for r in records)
        n_seen += len(batch)
        bar.update(len(batch))
        bar.set_postfix(acc=f"{n_right / n_seen:.3f}")
    bar.close()

    samples = [by_id[e.id] for e in examples]
    summary = {"mode": mode, **(info or {}), **summarize(samples, n_boot=n_boot, seed=seed)}
    # times: the slowest process's (each process times its own rows' tools)
    seconds, device, tool = hosts.allgather(np.array([[time.perf_counter() - t0, stats.seconds_device,
                                                       stats.seconds_tools]])).max(axis=0).tolist()
    summary["run"] = {"new_examples": len(todo), "resumed_examples": len(examples) - len(todo),
                      "seconds": seconds, "seconds_device": device, "seconds_tools": tool, "sampled_tokens": sampled,
                      "slot_utilisation": _num(stats.utilisation(sampled)),  # the engine's, over every batch
                      "episode": {"max_turns": config.max_turns, "max_response_tokens": config.max_response_tokens,
                                  "max_obs_tokens": config.max_obs_tokens, "max_concurrent": config.max_concurrent,
                                  "sampler": dataclasses.asdict(config.sampler)}}
    if not hosts.is_writer():
        return summary
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    c = [s["correct"] for s in samples]
    q = [s["confidence"] for s in samples]
    title = f"{mode} on {info['data']}" if info and "data" in info else mode
    reliability_diagram(c, q, out / PLOT_FILE, title=title)
    return summary
