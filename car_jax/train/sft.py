"""Supervised warm start: cross-entropy on given trajectories, with the same loss mask
as RL (tool observations and the prompt are not trained on). For small models that do
not follow the tag format yet.

Data: JSONL, one trajectory a line:
    {"messages": [chat messages of the prompt], "segments": [{"text": "...", "train": true}, ...]}
or  {"messages": [...], "response": "..."}  (the whole response is trained on).
A line may add "tools": ["search", "code"] (action kinds): its prompt is then rendered by the
tokenizer's chat template with those tools listed (`data.chat_tools.tool_prompts`), as the
`qwen` protocol's prompts are.
`data = "world"` builds demonstrations from the offline world instead (`world_demos`; with
the `mixed` template `tool_demos`, which teach both tools, and with the `qwen` template the
same in Qwen's native tool calls); `data = "chance"` builds the positive control's
(`chance_demos`: the layout, with uninformative confidences).
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
from car_jax.data.chat_tools import tool_prompts
from car_jax.rl.batches import micro_batches, share_prompts, to_device
from car_jax.rl.host_batch import host_batch, longest, micro_plan
from car_jax.rollout.episode import Trajectory
from car_jax.rollout.generate import prompt_texts
from car_jax.rollout.protocols import Action, Mixed, Qwen
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
    if template in TOOL_DEMOS:
        raise ValueError(f"world_demos writes search demonstrations in the tag layout; for the {template} "
                         f"template use tool_demos(..., template={template!r}), which also teaches the code tool")
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
    thought = THOUGHTS["search"][hit]
    return [{"text": f"{_thought('I should look this up.')}<search> {ex.question} </search>", "train": True},
            {"text": f"\n\n<information>{docs.strip()}</information>\n\n", "train": False},
            _ending(thought, ex.golden_answers[0] if hit else "unknown", conf)]


def _thought(text: str, template: str = "search") -> str:
    """A demonstration's thought as the template's layout writes it: in `<think>` tags, or
    (qwen) as prose before Qwen's calls and answer."""
    return f"{text}\n" if template == "qwen" else f"<think> {text} </think>\n"


def _ending(thought: str | None, answer: str, conf: int, template: str = "search") -> dict:
    """The answer and confidence a demonstration ends with (after a thought, if one is given)."""
    think = "" if thought is None else _thought(thought, template)
    return {"text": f"{think}<answer> {answer} </answer>\n<confidence> {conf} </confidence>", "train": True}


def _prints(result: str, golds) -> bool:
    """Whether a code observation (`Code execution result: <stdout>`) printed a gold number."""
    out = result.removeprefix(OBSERVATION_PREFIX).strip()
    try:
        return any(Fraction(out) == Fraction(g) for g in golds)
    except (ValueError, ZeroDivisionError):
        return False


def _call(template: str, kind: str, payload: str) -> str:
    """The model's text of one tool call: the tag layout (`mixed`: `<search>`, a fenced
    program) or Qwen's (`<tool_call>` JSON, as its chat template renders a call)."""
    if template == "qwen":
        name, arg = ("search", "query") if kind == "search" else ("python", "code")
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {arg: payload}}, ensure_ascii=False)}\n</tool_call>"
    return f"<search> {payload} </search>" if kind == "search" else f"```python\n{payload}\n```"


# what a demonstration thinks before answering: action kind -> (not found, found)
THOUGHTS = {"search": ("The documents do not say.", "The documents give the answer."),
            "code": ("The program did not give the answer.", "The program gives the answer.")}
# template -> the protocol whose observations a demonstration splices in
TOOL_DEMOS = {"mixed": Mixed(), "qwen": Qwen()}


def tool_demos(examples, tools: dict, confidence: int | str = "informative", seed: int = 0,
               template: str = "mixed") -> list[dict]:
    """One demonstration per example teaching both tools, in `template`'s layout ("mixed":
    the tags and fenced programs of the `Mixed` protocol; "qwen": `<tool_call>` JSON and
    `<tool_response>` turns of the `Qwen` protocol, the prompt listing the tools through the
    chat template, the line's "tools"). A QA example searches its question with
    tools["search"]; a math example (a world-large word problem: meta `op`) writes the
    program that computes its answer (`world_arith.program`) and runs it with tools["code"];
    each observation is written as the template's protocol writes it, and the answer is the
    gold when the documents hold it / the program printed it, else "unknown". The stated
    confidence follows `confidence` (`demo_confidences`; "informative": high when the answer
    was found, low otherwise). `tools`: a Toolbox's tools (`open_tools("mixed", ...)`),
    batched callables."""
    if template not in TOOL_DEMOS:
        raise ValueError(f"tool demonstrations are written for the templates {sorted(TOOL_DEMOS)}, not "
                         f"{template!r}; for the search template use world_demos")
    protocol = TOOL_DEMOS[template]
    if missing := sorted({"search" if ex.task == "qa" else "code" for ex in examples} - set(tools)):
        raise ValueError(f"{template} demonstrations need a {missing[0]!r} tool, got {sorted(tools)}: open the "
                         f"tools of rollout.protocol={template}")
    no_op = [ex.id for ex in examples if ex.task == "math" and ex.meta.get("op") not in world_arith.OPS]
    if no_op:
        raise ValueError(f"{template} demonstrations write a program only for world-large word problems (meta op), "
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
        kind = "search" if ex.task == "qa" else "code"
        payload, result = (ex.question, docs[ex.id]) if kind == "search" else (programs[ex.id], results[ex.id])
        thought = THOUGHTS[kind][hit]
        call = _thought("I should look this up." if kind == "search" else "I should calculate this.", template)
        ending = _ending(thought, ex.golden_answers[0] if hit else "unknown", conf, template)
        segments = [{"text": call + _call(template, kind, payload), "train": True},
                    {"text": protocol.observation(Action(kind, payload), result), "train": False}, ending]
        demo = {"messages": make_prompt(ex, template), "segments": segments}
        demos.append(demo | ({"tools": ["search", "code"]} if template == "qwen" else {}))
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
    """Trajectories (prompt ids, response ids, loss mask) from demonstration dicts (a
    "tools" entry: the prompt rendered with those tools listed, `tool_prompts`)."""
    groups: dict[tuple, list[int]] = {}  # the lines' "tools" -> their indices: one render (and check) per set
    for i, demo in enumerate(demos):
        groups.setdefault(tuple(demo.get("tools") or ()), []).append(i)
    prompts = [""] * len(demos)
    for tools, rows in groups.items():
        messages = [demos[i]["messages"] for i in rows]
        texts = tool_prompts(tokenizer, messages, tools, "an SFT line's \"tools\"") if tools else \
            prompt_texts(tokenizer, messages)
        for i, text in zip(rows, texts):
            prompts[i] = text
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
