"""Evaluation: greedy episodes over a dataset, scored for correctness and calibration.

    summary = evaluate(model, tokenizer, examples, EvalOptions(mode="search"), tools={"search": retriever},
                       out_dir="runs/eval-search")

Modes (prompt template, action protocol, tool):
    search  CAR search prompt, `car_search()` (Search-R1 tags, answer runs on to </confidence>),
            tool "search"
    direct  no-tool prompt, the same protocol with `max_turns=0`: one segment, no tool
    tir     TIR prompt, `TIR()` protocol, tool "code" (the Python sandbox); math examples only
    mixed   mixed prompt, `Mixed()` protocol, both tools ("search" and "code") in one episode;
            QA and math examples alike (world-large mixed_train / mixed_dev)
    qwen    qwen prompt rendered by the tokenizer's chat template with the tools listed
            (`data.chat_tools.tool_prompts`: Qwen2.5 / Qwen3 Instruct), `Qwen()` protocol
            (native `<tool_call>` JSON), both tools; a QA response's format is checked by
            Qwen's turns (`calibration.chat_format`), not the tag chain
Scoring (`car_jax.calibration.rewards.reward_inputs`, with each example's task): "qa" = exact match of the
last <answer>, format = the full tag chain (mode qwen: its turns); "math" = math-verify on the last <answer> or
\\boxed{}, format = the confidence parses. A missing confidence counts as q = 0.

Files written to `out_dir`:
    samples.jsonl    one line per example, appended as each batch finishes (fsync'd), so a
                     crash loses at most the batch in flight; `resume=True` skips ids already
                     there (a torn last line from a crash is cut off first)
    summary.json     metrics (`car_jax.calibration.metrics.calibration`) over all examples, percentile
                     bootstrap 95% intervals, mean turns / tool calls, format-valid rate,
                     per-kind breakdown; NaN (undefined AUROC / MCIP) is written as null
    reliability.png  reliability diagram of the stated confidence (greedy episodes);
                     reliability_expected.png of the expected confidence, and
                     reliability_sampled.png of the sampled episodes when they ran

Three confidences are scored, each with ECE, AUROC, Brier and the rest of
`car_jax.calibration.metrics.KEYS` (summary.json: the top level, `expected`, `sampled`):
- stated: the number the greedy episode wrote (q = 0 when missing, SPEC 4);
- expected (with a model): the policy's expected confidence at the greedy episode's last
  `<confidence>` tag, sum_v P(v) v / 100 over its next-token distribution on the values
  0..100, from one batched teacher-forced pass over the 101 continuations after the
  episode's own tokens (`car_jax.rl.confidence`: tokenization, the token boundary at the
  tag, the model's layout), at the last tag the model wrote itself (a tag inside a tool's
  observation does not count). A response without one has expected q = 0, the convention
  of a missing stated confidence (`tag_rate` in the section: the share with a tag). samples.jsonl keeps, per example, `expected_confidence`,
  `confidence_mode` (the most probable value), `confidence_dist` (the 101 probabilities,
  rounded to 6 decimals) and `confidence_tail` (the continuation pattern), null without a
  tag; the summary's `expected` section is computed from `expected_confidence`;
- sampled (`samples=k`, 0 = off): k more episodes per question at temperature
  SAMPLE_TEMPERATURE = 1 (the policy's own distribution) and top_p `sample_top_p` (default
  0.95, Search-R1's rollout setting, SPEC 6), top_k off, seeded (`seed` + SAMPLE_SEED +
  the batch offset; episode i of a call draws from its own stream), scored like the greedy
  ones. samples.jsonl keeps them per example as `sampled` (answer, correct, confidence,
  confidence_ok, format_ok, n_turns, n_tool_calls; no response text); the `sampled` section
  pools the k x N episodes, without bootstrap intervals (the k episodes of a question are
  not the independent draws `metrics.bootstrap_ci` resamples).

The tables (`format_table`, `compare_table`; `pilot.format_pilot` and the experiment's
RESULTS.md use the same rule) mark the metrics of a column whose format-valid rate is below
FALLBACK_BELOW = 0.5 with FALLBACK_MARK and print FALLBACK_NOTE under the table: such a
column mostly scores the fallbacks above (no answer: wrong; no confidence: q = 0). Its
"mean model turns" (`Trajectory.n_turns`, at most max_turns + 1) is defined under it too.

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
from car_jax.config import require
from car_jax.data.chat_tools import check_tool_template, tool_prompts
from car_jax.data.examples import QAExample
from car_jax.data.prompts import make_prompt
from car_jax.rl.confidence import confidence_prefix, expected_q, mode_value, value_distribution
from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
from car_jax.rollout.protocols import TIR, Mixed, Qwen, car_search
from car_jax.rollout.toolbox import tool_names

SAMPLES_FILE, SUMMARY_FILE, PLOT_FILE = "samples.jsonl", "summary.json", "reliability.png"
EXPECTED_PLOT, SAMPLED_PLOT = "reliability_expected.png", "reliability_sampled.png"
SAMPLE_TEMPERATURE = 1.0  # the sampled episodes' temperature: the policy's own distribution
SAMPLE_TOP_P = 0.95  # their default top_p: Search-R1's rollout setting (SPEC 6), training's default
SAMPLE_SEED = 1_000_003  # the sampled episodes' seed: seed + SAMPLE_SEED + the batch's offset
# greedy decoding (Search-R1's validation), 4 search turns of 500 tokens, 500-token observations
EVAL_EPISODE = EpisodeConfig(max_turns=4, max_response_tokens=500, max_obs_tokens=500, temperature=0.0, top_p=1.0)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How one evaluation mode prompts and acts: template name, protocol factory, tool kind;
    `single_turn`: no tool call (max_turns=0); `chat_tools`: the prompt is rendered by the
    tokenizer's chat template with the tools listed (native tool calls)."""

    name: str
    template: str
    protocol: Callable[[], object]
    tool: str | None  # the tool kind the mode calls (`toolbox.tool_names`), None for no tool
    single_turn: bool = False
    chat_tools: bool = False

    def prompts(self, examples: Sequence[QAExample], tokenizer=None) -> list:
        """The episodes' prompts: chat messages, or (chat_tools) texts rendered with the tools."""
        messages = [make_prompt(e, self.template) for e in examples]
        if not self.chat_tools:
            return messages
        return tool_prompts(tokenizer, messages, tool_names(self.tool), f"car-jax eval mode={self.name!r}")


MODES = {
    "search": Mode("search", "search", car_search, "search"),
    "direct": Mode("direct", "direct", car_search, None, single_turn=True),
    "tir": Mode("tir", "tir", TIR, "code"),
    "mixed": Mode("mixed", "mixed", Mixed, "mixed"),
    "qwen": Mode("qwen", "qwen", Qwen, "mixed", chat_tools=True),
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
    The format is checked by the grammar of `mode`'s protocol (`pieces.GRAMMARS`).

    Record: id, question, golden_answers, data_source, mode, response, answer (None when the
    response has none), confidence (q in [0, 1], 0 when missing), confidence_ok, correct (bool),
    format_ok (bool), format_reason, plus `kind` / `answerable` when the example's meta has them.
    """
    out, grammar = [], get_mode(mode).protocol().grammar
    for ex, response in zip(examples, responses, strict=True):
        inputs = reward_inputs([response], [list(ex.golden_answers)], task=ex.task, grammar=grammar)
        parsed = pieces.parse_pieces(response, grammar)
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


def _scored(c, q, n_boot: int, seed: int) -> dict:
    """The metrics (`metrics.calibration`) of bool[B] correctness and float[B] confidence,
    NaN as None, with their percentile bootstrap 95% intervals under "ci95" ({} for n_boot 0)."""
    m = metrics.calibration(c, q)
    ci = metrics.bootstrap_ci(c, q, n_boot=n_boot, seed=seed) if n_boot else {}
    out = {k: _num(v) for k, v in m.items()}
    out["ci95"] = {k: [_num(lo), _num(hi)] for k, (lo, hi) in ci.items()}
    return out


def _expected_section(samples: Sequence[dict], n_boot: int, seed: int) -> dict | None:
    """The metrics of the expected confidence (every record's `expected_confidence`), and
    the share of responses with a `<confidence>` tag; None (with a warning when only some
    records have it) unless every record has one."""
    have = sum("expected_confidence" in s for s in samples)
    if have < len(samples):
        if have:
            warnings.warn(f"{len(samples) - have} of {len(samples)} records have no expected_confidence "
                          "(samples from an earlier run?): no expected-confidence metrics")
        return None
    c = np.array([s["correct"] for s in samples], bool)
    q = np.array([s["expected_confidence"] for s in samples], np.float64)
    tagged = float(np.mean([s.get("confidence_dist") is not None for s in samples]))
    return {**_scored(c, q, n_boot, seed), "tag_rate": tagged}


def _sampled_section(samples: Sequence[dict]) -> dict | None:
    """The metrics of every record's k sampled episodes pooled (k x N of them; no
    intervals, see the module docstring), their format and confidence rates and mean tool
    calls; None (with a warning when only some records have them, or k differs) unless
    every record holds the same number k >= 1 of them."""
    lists = [s.get("sampled") for s in samples]
    ks = {len(x) for x in lists if x}
    if not any(lists):
        return None
    if len(ks) > 1 or not all(lists):
        warnings.warn(f"sampled episodes: records hold {sorted(ks | ({0} if not all(lists) else set()))} of them, "
                      "not one k for all (samples from several runs?): no sampled metrics")
        return None
    pooled = [e for x in lists for e in x]
    out = _scored([e["correct"] for e in pooled], [e["confidence"] for e in pooled], 0, 0)
    del out["ci95"]
    out.update(k=ks.pop(), episodes=len(pooled))
    for key, field in (("format_rate", "format_ok"), ("confidence_rate", "confidence_ok"),
                       ("mean_tool_calls", "n_tool_calls")):
        out[key] = float(np.mean([float(e[field]) for e in pooled])) if all(field in e for e in pooled) else None
    return out


def summarize(samples: Sequence[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """Sample records -> the summary dict (metric names of `car_jax.calibration.metrics.KEYS`
    at top level: the stated confidence), with an `expected` section (records with
    `expected_confidence`) and a `sampled` one (records with `sampled` episodes) when
    the records hold them."""
    c = np.array([s["correct"] for s in samples], bool)
    q = np.array([s["confidence"] for s in samples], np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _scored(c, q, n_boot, seed)
        for name, section in (("expected", _expected_section(samples, n_boot, seed)),
                              ("sampled", _sampled_section(samples))):
            if section is not None:
                out[name] = section
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


# ---------------------------------------------------------------- tables
# A column (a policy, a split, a section) whose format-valid rate is below FALLBACK_BELOW
# scores mostly the fallbacks of `score` (no answer: wrong; no confidence: q = 0): the
# tables mark its metrics with FALLBACK_MARK and print FALLBACK_NOTE under them.
FALLBACK_BELOW = 0.5
FALLBACK_MARK = "*"
FALLBACK_NOTE = (f"{FALLBACK_MARK} format valid below {FALLBACK_BELOW:g}: mostly fallback values, not the model's "
                 "calibration. Each response is scored as written: without an <answer> (math: nor a \\boxed{}) it "
                 "counts as wrong, without a parseable <confidence> (a number in 0..100) as q = 0, and wrong at q = 0 "
                 "scores ECE and Brier 0.")
FALLBACK_KEYS = ("accuracy", "ece", "mcip", "auroc", "brier", "mean_confidence")  # the metrics the mark goes on


def is_fallback(format_rate: float | None) -> bool:
    """Whether a column with this format-valid rate shows fallback values (None, NaN: unknown, no)."""
    return format_rate is not None and not math.isnan(format_rate) and format_rate < FALLBACK_BELOW


def turns_note(summary: dict) -> str:
    """The one-line definition of the table's "mean model turns" (`Trajectory.n_turns`)."""
    max_turns = ((summary.get("run") or {}).get("episode") or {}).get("max_turns")
    bound = "max_turns + 1" if max_turns is None else f"max_turns + 1 = {max_turns + 1}"
    return ("model turns: the segments the model wrote per episode, one per tool call or invalid action, then the "
            f"last (its answer, or the answer-only turn once max_turns are used); at most {bound}")


def _cell(section: dict, key: str, mark: bool = False) -> str:
    """A value with its 95% interval when the section has one; n/a when undefined;
    FALLBACK_MARK after the value when `mark`."""
    v, ci = section.get(key), section.get("ci95", {}).get(key)
    if v is None:
        return "n/a"
    return f"{v:.3f}{FALLBACK_MARK * mark}" + (f"  [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci else "")


CONFIDENCE_ROWS = (("ECE", "ece"), ("AUROC", "auroc"), ("Brier", "brier"), ("mean confidence", "mean_confidence"))


def _section_rows(summary: dict) -> list[tuple[str, str]]:
    """The table's rows for the expected and the sampled confidence, where the summary has
    them; the expected rows marked as the greedy episodes' (theirs are the tags it reads),
    the sampled rows by the sampled episodes' own format-valid rate."""
    rows = []
    if (e := summary.get("expected")) is not None:
        mark = is_fallback(summary.get("format_rate"))
        rows.append((f"expected q at the tag (tag in {e['tag_rate']:.3f})", ""))
        rows += [(f"  {label}", _cell(e, key, mark)) for label, key in CONFIDENCE_ROWS]
    if (s := summary.get("sampled")) is not None:
        mark = is_fallback(s.get("format_rate"))
        rows.append((f"sampled episodes (k={s['k']}, {s['episodes']} in all)", ""))
        rows += [(f"  {label}", _cell(s, key, mark)) for label, key in (("accuracy", "accuracy"), *CONFIDENCE_ROWS)]
        if s.get("format_rate") is not None:
            rows.append(("  format valid", f"{s['format_rate']:.3f}"))
    return rows


def format_table(summary: dict) -> str:
    """A short text table of the main numbers with their 95% intervals: the stated
    confidence's, then the expected confidence's and the sampled episodes' when the
    summary has them. Metrics of a part whose format-valid rate is below FALLBACK_BELOW
    are marked, with FALLBACK_NOTE under the table; the definition of model turns follows
    when the table shows them."""
    mark = is_fallback(summary.get("format_rate"))
    cell = functools.partial(_cell, summary)
    rows = [("examples", str(summary["n"]))]
    rows += [(label, cell(key, mark)) for label, key in (("accuracy", "accuracy"), ("ECE", "ece"), ("MCIP", "mcip"),
                                                         ("AUROC", "auroc"), ("Brier", "brier"),
                                                         ("mean confidence", "mean_confidence"))]
    for key, label in (("format_rate", "format valid"), ("mean_turns", "mean model turns"),
                       ("mean_tool_calls", "mean tool calls")):
        if summary.get(key) is not None:
            rows.append((label, f"{summary[key]:.3f}"))
    rows += _section_rows(summary)
    for kind, sub in summary.get("by_kind", {}).items():
        m = FALLBACK_MARK * is_fallback(sub.get("format_rate"))
        rows.append((f"  {kind} (n={sub['n']})",
                     f"acc {sub['accuracy']:.3f}{m}, mean q {sub['mean_confidence']:.3f}{m}"))
    width = max(len(r[0]) for r in rows)
    head = f"mode {summary.get('mode', '?')}  (95% bootstrap intervals)"
    lines = [head] + [f"{k.ljust(width)}  {v}".rstrip() for k, v in rows]
    if any(FALLBACK_MARK in v for _, v in rows):
        lines.append(FALLBACK_NOTE)
    if summary.get("mean_turns") is not None:
        lines.append(turns_note(summary))
    return "\n".join(lines)


COMPARE_ROWS = (("accuracy", "accuracy"), ("ECE", "ece"), ("MCIP", "mcip"), ("AUROC", "auroc"),
                ("Brier", "brier"), ("mean confidence", "mean_confidence"), ("format valid", "format_rate"),
                ("mean tool calls", "mean_tool_calls"),
                # the sections' rows (section.key), shown when some summary has the section
                ("ECE, expected q", "expected.ece"), ("AUROC, expected q", "expected.auroc"),
                ("Brier, expected q", "expected.brier"), ("accuracy, sampled", "sampled.accuracy"),
                ("ECE, sampled", "sampled.ece"), ("AUROC, sampled", "sampled.auroc"),
                ("Brier, sampled", "sampled.brier"))


def _column_fallback(summary: dict, key: str) -> bool:
    """Whether row `key` of a summary's column shows fallback values: a metric (FALLBACK_KEYS)
    of a part (the summary; the expected section reads the greedy episodes' tags; the
    sampled section its own episodes) whose format-valid rate is below FALLBACK_BELOW."""
    section, _, name = key.rpartition(".")
    if name not in FALLBACK_KEYS:
        return False
    rate = (summary.get("sampled") or {}).get("format_rate") if section == "sampled" else summary.get("format_rate")
    return is_fallback(rate)


def compare_table(summaries: dict[str, dict]) -> str:
    """One text table with a column per summary ({column label: summary}), a row per metric
    (accuracy, ECE, MCIP, AUROC, Brier, mean confidence, format valid, mean tool calls; then
    ECE, AUROC and Brier of the expected confidence and of the sampled episodes where any
    summary has them), and the last column minus the first. Undefined values (AUROC of a
    one-class set, a section a summary lacks) print n/a. A column's metrics whose format-valid
    rate is below FALLBACK_BELOW (and a change from or to one) are marked, with FALLBACK_NOTE
    under the table."""
    labels = list(summaries)

    def value(summary, key):
        section, _, name = key.rpartition(".")
        v = (summary.get(section) or {}).get(name) if section else summary.get(name)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    head = ["metric", *labels] + (["change"] if len(labels) > 1 else [])
    body, marked = [], False
    for name, key in COMPARE_ROWS:
        section = key.rpartition(".")[0]
        if section and not any(summaries[label].get(section) for label in labels):
            continue
        vals = [value(summaries[label], key) for label in labels]
        marks = [FALLBACK_MARK * _column_fallback(summaries[label], key) for label in labels]
        cells = ["n/a" if v is None else f"{v:.3f}{m}" for v, m in zip(vals, marks)]
        if len(labels) > 1:
            first, last = vals[0], vals[-1]
            m = FALLBACK_MARK * bool(marks[0] or marks[-1])
            cells.append("n/a" if first is None or last is None else f"{last - first:+.3f}{m}")
        marked |= any(c.endswith(FALLBACK_MARK) for c in cells)
        body.append([name, *cells])
    body.append(["examples", *(str(summaries[label]["n"]) for label in labels)] + ([""] if len(labels) > 1 else []))
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)] + [FALLBACK_NOTE] * marked)


# ---------------------------------------------------------------- the loop
def _run_batch(run: Callable, batch: list[QAExample], spec: Mode, mesh, tokenizer=None,
               prefixes: bool = True) -> tuple[list[dict], int, list]:
    """One batch's episodes (`run(prompts)`: run_episodes with the loop's settings; the
    prompts `spec.prompts`, rendered with `tokenizer` for a chat-tools mode) ->
    (its sample records in batch order, in every process; tokens the model sampled for
    them; each episode's confidence prefix, `rl.confidence.confidence_prefix` of its own
    tags (None without a tag, or when no tokenizer is given or `prefixes` is off), in batch order in every
    process). On a mesh the rows are padded with copies of the last example to a multiple
    of fsdp and each process runs its block of them; padded rows' results are dropped."""
    rows = batch + [batch[-1]] * (-len(batch) % (1 if mesh is None else mesh.shape["fsdp"]))
    mine = hosts.local_rows(len(rows), mesh)
    trajs = run(spec.prompts(rows[mine], tokenizer))
    real = max(0, min(mine.stop, len(batch)) - mine.start)  # this process's rows that are not padding
    trajs = trajs[:real]
    records = score(batch[mine.start:mine.start + real], [t.pieces for t in trajs], spec.name)
    for rec, t in zip(records, trajs):
        rec.update(n_turns=t.n_turns, n_tool_calls=t.n_tool_calls, answered=t.answered,
                   tool_requests=[log["request"] for log in t.tool_log])
    prefixes = [None] * len(trajs) if tokenizer is None or not prefixes else [
        confidence_prefix(t.prompt_ids, t.response_ids, tokenizer, sampled=t.loss_mask) for t in trajs]
    parts = hosts.allgather_objects({"start": mine.start, "records": records, "prefixes": prefixes,
                                     "sampled": sum(int(t.loss_mask.sum()) for t in trajs)})
    parts.sort(key=lambda p: p["start"])
    return ([r for p in parts for r in p["records"]], sum(p["sampled"] for p in parts),
            [x for p in parts for x in p["prefixes"]])


NO_TAG = {"expected_confidence": 0.0, "confidence_mode": None, "confidence_dist": None, "confidence_tail": None}


def expected_fields(model, tokenizer, prefixes: Sequence) -> list[dict]:
    """Each episode's expected-confidence fields for its record, from its confidence prefix
    ((prefix ids, tail pattern), or None: no tag): `expected_confidence` (q in [0, 1]; 0
    without a tag, as a missing stated confidence), `confidence_mode` (the most probable
    value 0..100), `confidence_dist` (the 101 probabilities, rounded to 6 decimals) and
    `confidence_tail`; None in the last three without a tag. One `value_distribution` pass
    over the episodes with a tag (every process calls it with the same prefixes)."""
    tagged = [i for i, p in enumerate(prefixes) if p is not None]
    out = [dict(NO_TAG) for _ in prefixes]
    if not tagged:
        return out
    dist = value_distribution(model, tokenizer, [prefixes[i][0] for i in tagged], [prefixes[i][1] for i in tagged])
    q, top = np.clip(expected_q(dist), 0.0, 1.0), mode_value(dist)
    for j, i in enumerate(tagged):
        out[i] = {"expected_confidence": float(q[j]), "confidence_mode": int(top[j]),
                  "confidence_dist": [round(float(p), 6) for p in dist[j]], "confidence_tail": prefixes[i][1]}
    return out


SAMPLED_FIELDS = ("answer", "correct", "confidence", "confidence_ok", "format_ok", "n_turns", "n_tool_calls")


def _sampled_episodes(run: Callable, batch: list[QAExample], k: int, spec: Mode, mesh,
                      tokenizer=None) -> tuple[list[list[dict]], int]:
    """k sampled episodes of each example of the batch (`run`: run_episodes at the sampled
    settings) -> (per example its k scored episodes, SAMPLED_FIELDS only; tokens sampled)."""
    records, n_sampled, _ = _run_batch(run, [e for e in batch for _ in range(k)], spec, mesh, tokenizer,
                                       prefixes=False)
    kept = [{f: r[f] for f in SAMPLED_FIELDS} for r in records]
    return [kept[i * k:(i + 1) * k] for i in range(len(batch))], n_sampled


def sampled_config(config: EpisodeConfig, top_p: float = SAMPLE_TOP_P) -> EpisodeConfig:
    """The sampled episodes' settings: `config` at SAMPLE_TEMPERATURE, `top_p`, top_k off."""
    return dataclasses.replace(config, temperature=SAMPLE_TEMPERATURE, top_p=top_p, top_k=0)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How `evaluate` runs (`car-jax eval` builds it from its EvalConfig's keys of the same
    names, resume and n_boot from its `output` section: `job.eval_options`)."""
    mode: str = "search"  # a key of MODES
    episode: EpisodeConfig = EVAL_EPISODE  # used as given (greedy, 4 turns, 500 tokens a turn); direct: max_turns=0
    batch_size: int = 8  # examples whose episodes run together
    resume: bool = False  # continue out_dir's samples.jsonl; False refuses a folder that already has samples
    n_boot: int = 1000  # bootstrap resamples for the summary's 95% intervals (0: none)
    seed: int = 0  # the episodes' (batch b: seed + its offset) and the bootstrap's
    samples: int = 0  # k sampled episodes per example beside the greedy one (0: none)
    sample_top_p: float = SAMPLE_TOP_P  # their top_p (`sampled_config`)
    progress: bool = True  # the progress bar (process 0 only)

    def __post_init__(self):
        require(self.samples >= 0, "samples", self.samples, ">= 0 (sampled episodes per example; 0: none)")
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1 (examples whose episodes run together)")
        require(self.n_boot >= 0, "n_boot", self.n_boot, ">= 0 (bootstrap resamples; 0: no intervals)")


def evaluate(model, tokenizer, examples: Sequence[QAExample], options: EvalOptions = EvalOptions(), *,
             tools: dict | None = None, out_dir: str | Path, info: dict | None = None) -> dict:
    """Runs `options.mode` on every example, writes samples.jsonl / summary.json /
    reliability.png to `out_dir`, returns the summary dict.

    tools: action kind -> batched tool ({"search": retriever} / {"code": PythonTool()}); the
    mode's tool must be there (direct mode needs none). `options.episode` is used as given
    (default greedy, 4 turns, 500 tokens per turn); direct mode forces `max_turns=0`.
    options.resume=False refuses to write into a folder that already has samples (set
    resume=True to continue it, or pass another out_dir). `info` (model, dataset, ...) is
    copied into the summary. With a model, each greedy episode's expected confidence is
    measured at its tag (`expected_fields`); `options.samples` = k >= 1 runs k sampled
    episodes per example as well (`sampled_config(options.episode, options.sample_top_p)`;
    see the module docstring).
    """
    mode, batch_size, resume, seed, samples = (options.mode, options.batch_size, options.resume, options.seed,
                                               options.samples)
    spec = get_mode(mode)
    examples = list(examples)
    if not examples:
        raise ValueError("evaluate needs at least one example")
    tools = dict(tools or {})
    if missing := [name for name in tool_names(spec.tool) if name not in tools]:
        raise ValueError(f"mode {mode!r} needs a {missing[0]!r} tool in tools=, got {sorted(tools)}")
    if spec.chat_tools:  # before any episode: the tokenizer's template must list the tools
        check_tool_template(tokenizer, tool_names(spec.tool), f"car-jax eval mode={mode!r}")
    if mode == "tir" and (bad := [e.id for e in examples if e.task != "math"]):
        raise ValueError(f"mode 'tir' scores math answers, but {len(bad)} examples are QA (e.g. {bad[0]!r}); "
                         "use a math dataset (MATH-500: problem, answer; AIME 2024: Problem, Answer) "
                         "or mode 'search'/'direct'")
    config = dataclasses.replace(options.episode, max_turns=0) if spec.single_turn else options.episode
    mesh = None if model is None else model.mesh  # None: no model (tests script run_episodes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES_FILE
    done_rows = _done_records(path, resume)
    if not resume and path.is_file() and path.stat().st_size:
        raise FileExistsError(f"{path} already holds samples; pass EvalOptions(resume=True) (car-jax eval: "
                              "output.resume=true) to continue that run, or choose another out_dir")
    other = {r.get("mode") for r in done_rows} - {mode}
    if other:
        raise ValueError(f"{path} holds samples of mode {sorted(other)}, not {mode!r}; use another out_dir")
    done = {r["id"] for r in done_rows}
    todo = [e for e in examples if e.id not in done]

    stats, t0, sampled = EpisodeStats(), time.perf_counter(), 0
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=f"eval {mode}", unit="q",
               disable=not options.progress or not hosts.is_writer())
    wanted = {e.id for e in examples}
    by_id = {r["id"]: r for r in done_rows}  # the summary's records, kept here (not re-read from the file)
    n_seen = len(examples) - len(todo)
    n_right = sum(r["correct"] for r in done_rows if r["id"] in wanted)
    sample_cfg = sampled_config(config, options.sample_top_p)
    seconds_expected = 0.0
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        run = functools.partial(run_episodes, model, tokenizer, tools=tools, config=config, protocol=spec.protocol(),
                                seed=seed + start, stats=stats)
        records, n_sampled, prefixes = _run_batch(run, batch, spec, mesh, tokenizer, prefixes=model is not None)
        if model is not None:  # no model: tests script run_episodes
            t_expected = time.perf_counter()
            for rec, fields in zip(records, expected_fields(model, tokenizer, prefixes)):
                rec.update(fields)
            seconds_expected += time.perf_counter() - t_expected
        if samples:
            run = functools.partial(run_episodes, model, tokenizer, tools=tools, config=sample_cfg,
                                    protocol=spec.protocol(), seed=seed + SAMPLE_SEED + start, stats=stats)
            per_example, n_more = _sampled_episodes(run, batch, samples, spec, mesh, tokenizer)
            for rec, episodes in zip(records, per_example):
                rec["sampled"] = episodes
            n_sampled += n_more
        if hosts.is_writer():
            _append(path, records)
        by_id.update((r["id"], r) for r in records)
        sampled += n_sampled
        n_right += sum(r["correct"] for r in records)
        n_seen += len(batch)
        bar.update(len(batch))
        bar.set_postfix(acc=f"{n_right / n_seen:.3f}")
    bar.close()

    rows = [by_id[e.id] for e in examples]
    summary = {"mode": mode, **(info or {}), **summarize(rows, n_boot=options.n_boot, seed=seed)}
    # times: the slowest process's (each process times its own rows' tools)
    seconds, device, tool = hosts.allgather(np.array([[time.perf_counter() - t0, stats.seconds_device,
                                                       stats.seconds_tools]])).max(axis=0).tolist()
    summary["run"] = {"new_examples": len(todo), "resumed_examples": len(examples) - len(todo),
                      "seconds": seconds, "seconds_device": device, "seconds_tools": tool, "sampled_tokens": sampled,
                      "slot_utilisation": _num(stats.utilisation(sampled)),  # the engine's, over every batch
                      "episode": {"max_turns": config.max_turns, "max_response_tokens": config.max_response_tokens,
                                  "max_obs_tokens": config.max_obs_tokens, "max_concurrent": config.max_concurrent,
                                  "sampler": dataclasses.asdict(config.sampler)},
                      "seconds_expected": seconds_expected,  # the expected-confidence passes
                      "sampled_episodes": {"k": samples, "seed": seed + SAMPLE_SEED,
                                           "sampler": dataclasses.asdict(sample_cfg.sampler)} if samples else None}
    if not hosts.is_writer():
        return summary
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    c = [s["correct"] for s in rows]
    title = f"{mode} on {info['data']}" if info and "data" in info else mode
    reliability_diagram(c, [s["confidence"] for s in rows], out / PLOT_FILE, title=title)
    if "expected" in summary:
        reliability_diagram(c, [s["expected_confidence"] for s in rows], out / EXPECTED_PLOT,
                            title=f"{title}, expected q at the tag")
    if "sampled" in summary:
        pooled = [e for s in rows for e in s["sampled"]]
        reliability_diagram([e["correct"] for e in pooled], [e["confidence"] for e in pooled], out / SAMPLED_PLOT,
                            title=f"{title}, sampled (k={summary['sampled']['k']})")
    return summary
