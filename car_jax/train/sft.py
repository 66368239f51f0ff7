"""Supervised warm start: cross-entropy on given trajectories, with the same loss mask
as RL (tool observations and the prompt are not trained on). For small models that do
not follow the tag format yet.

Data: JSONL, one trajectory a line:
    {"messages": [chat messages of the prompt], "segments": [{"text": "...", "train": true}, ...]}
or  {"messages": [...], "response": "..."}  (the whole response is trained on).
`data = "world"` builds demonstrations from the offline world instead (`world_demos`; with
the `mixed` template `mixed_demos`, which teach both tools); `data = "chance"` builds the
positive control's (`chance_demos`: the layout, with uninformative confidences).
"""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import jax
import numpy as np

from car_jax import hosts
from car_jax.calibration.parsing import normalize_answer
from car_jax.data import make_prompt, world_arith
from car_jax.rl.batches import micro_batches, share_prompts, to_device
from car_jax.rl.host_batch import host_batch, longest, micro_plan
from car_jax.rollout.episode import Trajectory
from car_jax.rollout.generate import prompt_texts
from car_jax.rollout.protocols import Action, Mixed
from car_jax.tools.python_tool import OBSERVATION_PREFIX
from car_jax.train.config import SFTConfig

FOUND_CONFIDENCE = 90  # what a demonstration states when the documents hold the answer
MISSING_CONFIDENCE = 10  # ... and when they do not


def demo_confidences(n: int, confidence: int | str, found: list[bool], seed: int = 0) -> list[int]:
    """The confidence (0-100) each of `n` demonstrations states:
    "informative"  FOUND_CONFIDENCE when its documents hold the answer, else MISSING_CONFIDENCE;
    an int c       c for every demonstration (no information about correctness);
    "random"       independent uniform integers in [0, 100] (numpy, `seed`): no information either.
    """
    if confidence == "informative":
        return [FOUND_CONFIDENCE if f else MISSING_CONFIDENCE for f in found]
    if confidence == "random":
        return np.random.default_rng(seed).integers(0, 101, size=n).tolist()
    if isinstance(confidence, int) and not isinstance(confidence, bool) and 0 <= confidence <= 100:
        return [confidence] * n
    raise ValueError(f"confidence={confidence!r}: give 'informative', 'random' or an integer in [0, 100]")


def world_demos(examples, retriever, template: str = "search", confidence: int | str = "informative",
                seed: int = 0) -> list[dict]:
    """One search demonstration per example: search the question, read the documents,
    answer with the gold answer when the documents contain it, else say "unknown"; the
    stated confidence follows `confidence` (`demo_confidences`: by default high when the
    documents hold the answer, low otherwise)."""
    if template == "mixed":
        raise ValueError("world_demos writes search demonstrations; for the mixed template use mixed_demos, "
                         "which also teaches the code tool")
    observations = retriever([ex.question for ex in examples])
    found = [any(normalize_answer(g) in normalize_answer(docs) for g in ex.golden_answers)
             for ex, docs in zip(examples, observations)]
    stated = demo_confidences(len(examples), confidence, found, seed)
    return [{"messages": make_prompt(ex, template), "segments": _search_segments(ex, docs, hit, conf)}
            for ex, docs, hit, conf in zip(examples, observations, found, stated)]


def chance_demos(examples, confidence: int | str = "random", seed: int = 0) -> list[dict]:
    """One demonstration per chance example (`car_jax.data.chance`), of the layout only:
    name the coin's kind and state a confidence that follows `confidence` (`demo_confidences`:
    "random" by default, an int for all), never the kind's p, so that the warm start's
    confidences carry no information about the kind and calibration can only come from RL."""
    if confidence == "informative":
        raise ValueError("chance demonstrations state no informative confidence: that is what RL must learn; "
                         "give 'random' or an integer")
    stated = demo_confidences(len(examples), confidence, [], seed)
    return [{"messages": make_prompt(ex, "chance"), "segments": [_ending(None, ex.meta["kind"], conf)]}
            for ex, conf in zip(examples, stated)]


def _search_segments(ex, docs: str, hit: bool, conf: int) -> list[dict]:
    """A search demonstration: search the question, read the docs, answer (or "unknown")."""
    thought = "The documents give the answer." if hit else "The documents do not say."
    return [{"text": f"<think> I should look this up. </think>\n<search> {ex.question} </search>", "train": True},
            {"text": f"\n\n<information>{docs.strip()}</information>\n\n", "train": False},
            _ending(thought, ex.golden_answers[0] if hit else "unknown", conf)]


def _ending(thought: str | None, answer: str, conf: int) -> dict:
    """The answer and confidence a demonstration ends with (after a thought, if one is given)."""
    think = "" if thought is None else f"<think> {thought} </think>\n"
    return {"text": f"{think}<answer> {answer} </answer>\n<confidence> {conf} </confidence>", "train": True}


def _prints(result: str, golds) -> bool:
    """Whether a code observation (`Code execution result: <stdout>`) printed a gold number."""
    out = result.removeprefix(OBSERVATION_PREFIX).strip()
    try:
        return any(Fraction(out) == Fraction(g) for g in golds)
    except (ValueError, ZeroDivisionError):
        return False


def mixed_demos(examples, tools: dict, confidence: int | str = "informative", seed: int = 0) -> list[dict]:
    """One demonstration per example with the `mixed` prompt, teaching both tools: a QA
    example searches its question with tools["search"] (as `world_demos`); a math example
    (a world-large word problem: meta `op`) writes the program that computes its answer
    (`world_arith.program`), runs it with tools["code"] (the observation as the `Mixed`
    protocol writes it) and answers with the gold when the program printed it, else
    "unknown". The stated confidence follows `confidence` (`demo_confidences`; "informative":
    high when the documents hold the answer / the program printed it, low otherwise).
    `tools`: a Toolbox's tools (`open_tools("mixed", ...)`), batched callables."""
    if missing := sorted({"search" if ex.task == "qa" else "code" for ex in examples} - set(tools)):
        raise ValueError(f"mixed demonstrations need a {missing[0]!r} tool, got {sorted(tools)}: open the tools "
                         "of rollout.protocol=mixed")
    no_op = [ex.id for ex in examples if ex.task == "math" and ex.meta.get("op") not in world_arith.OPS]
    if no_op:
        raise ValueError(f"mixed demonstrations write a program only for world-large word problems (meta op), "
                         f"not for {no_op[0]!r}; use data.train=world-large with a mixed or arith split")
    qa = [ex for ex in examples if ex.task == "qa"]
    math = [ex for ex in examples if ex.task == "math"]
    docs = dict(zip((ex.id for ex in qa), tools["search"]([ex.question for ex in qa]) if qa else []))
    programs = {ex.id: world_arith.program(ex.meta["op"], ex.question) for ex in math}
    results = dict(zip(programs, tools["code"](list(programs.values())) if math else []))
    found = [any(normalize_answer(g) in normalize_answer(docs[ex.id]) for g in ex.golden_answers) if ex.task == "qa"
             else _prints(results[ex.id], ex.golden_answers) for ex in examples]
    stated = demo_confidences(len(examples), confidence, found, seed)
    demos = []
    for ex, hit, conf in zip(examples, found, stated):
        if ex.task == "qa":
            segments = _search_segments(ex, docs[ex.id], hit, conf)
        else:
            program = programs[ex.id]
            thought = "The program gives the answer." if hit else "The program did not give the answer."
            call = f"<think> I should calculate this. </think>\n```python\n{program}\n```"
            segments = [{"text": call, "train": True},
                        {"text": Mixed().observation(Action("code", program), results[ex.id]), "train": False},
                        _ending(thought, ex.golden_answers[0] if hit else "unknown", conf)]
        demos.append({"messages": make_prompt(ex, "mixed"), "segments": segments})
    return demos


def write_demos(demos: list[dict], path: str | Path) -> Path:
    """Demonstrations as the JSONL `read_demos` reads (`sft.data=<path>`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in demos), encoding="utf-8")
    return path


def read_demos(path: str | Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" not in row or not ("segments" in row or "response" in row):
            raise ValueError(f"{path}:{n}: an SFT line needs 'messages' and 'segments' or 'response'")
        rows.append(row)
    return rows


def tokenize_demos(demos: list[dict], tokenizer) -> list[Trajectory]:
    """Trajectories (prompt ids, response ids, loss mask) from demonstration dicts."""
    prompts = prompt_texts(tokenizer, [d["messages"] for d in demos])
    out = []
    for demo, prompt in zip(demos, prompts):
        traj = Trajectory(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        segments = demo.get("segments") or [{"text": demo["response"], "train": True}]
        for seg in segments:
            ids = tokenizer(seg["text"], add_special_tokens=False)["input_ids"]
            traj.add(ids, np.zeros(len(ids), np.float32), sampled=bool(seg["train"]))
        out.append(traj)
    return out


def run_sft(state, step_fn, trajs: list[Trajectory], config: SFTConfig, *, pad_id: int, seed: int = 0,
            log=None, mesh=None):
    """`config.steps` SFT updates of `config.batch` trajectories each (cycling through a
    shuffle by `seed`; the optimizer, with `config.lr`, is `step_fn`'s). Each
    step's rows cross to the device once (`batches.to_device`); without a mesh,
    trajectories with the same prompt run it once (`host_batch.micro_plan`). Returns
    (state, losses)."""
    steps, batch = config.steps, config.batch
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(trajs))
    losses = []
    for step in range(steps):
        chosen = [trajs[order[(step * batch + i) % len(trajs)]] for i in range(batch)]
        mine = hosts.local_rows(batch, mesh)  # every process picks the same rows and sends its block
        host = share_prompts(host_batch(chosen[mine], pad_id, lengths=longest(chosen)), pad_id)
        prompt_of = hosts.allgather(host.prompt_of)
        data = micro_batches(to_device(host, mesh), micro_plan(prompt_of, np.arange(batch), batch, mesh is None),
                             mesh)
        state, metrics = step_fn(state, data)
        losses.append(float(metrics["sft_loss"]))
        if log is not None:
            log(step + 1, losses[-1])
    jax.block_until_ready(state.params)
    return state, losses
