"""Outcome rewards of CAR (the paper's MSCR and its baselines): jitted math over arrays, Letters: car_jax.dims.

Every reward takes `correct: bool[B]`, `q: float32[B]`, `format_ok: bool[B]` and returns
`float32[B]`; with c = correct as 0/1:

    binary          R = c
    brier (RLCR)    R = c - (q - c)^2                      (weighted_brier at w = 1)
    weighted_brier  R = c - w (q - c)^2,  w in (0, 1]       (car_jax's definition, w = 0.5)
    mscr            R = c [1 + b1 (1 - (1 - q)^2)] - (1 - c) b2 q^2,  b1, b2 > 0 (1, 1)

and then r = R - lambda_f where format_ok is False (lambda_f = `format_penalty`, 0.5).
q must already lie in [0, 1] (the parser guarantees it; it is not clipped here, so a bad q
shows up in the reward instead of being hidden). Hyperparameters are traced, not static:
changing them does not recompile.

A `RewardConfig` picks one of these functions on the host (`reward_fn`); nothing inside the
jitted code switches on strings. `reward_inputs` turns responses (an episode's pieces, or texts) into the three arrays.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from car_jax.calibration import parsing, pieces
from car_jax.config import require

RewardFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _penalize(r: jax.Array, format_ok: jax.Array, format_penalty) -> jax.Array:
    """r: f32[B] -> r - lambda_f where the format failed, f32[B]."""
    return (r - format_penalty * (1.0 - jnp.asarray(format_ok, jnp.float32))).astype(jnp.float32)


def _c_q(correct, q) -> tuple[jax.Array, jax.Array]:
    return jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)


@jax.jit
def binary(correct, q, format_ok, format_penalty=0.5) -> jax.Array:
    """Search-R1's reward R = c. bool[B], f32[B], bool[B] -> f32[B] (q is ignored)."""
    c, _ = _c_q(correct, q)
    return _penalize(c, format_ok, format_penalty)


@jax.jit
def weighted_brier(correct, q, format_ok, weight=0.5, format_penalty=0.5) -> jax.Array:
    """R = c - w (q - c)^2. bool[B], f32[B], bool[B] -> f32[B].

    For w < 1 a correct answer (R >= 1 - w) always beats a wrong one (R <= 0).
    """
    c, q = _c_q(correct, q)
    return _penalize(c - weight * (q - c) ** 2, format_ok, format_penalty)


@jax.jit
def brier(correct, q, format_ok, format_penalty=0.5) -> jax.Array:
    """RLCR's reward R = c - (q - c)^2. bool[B], f32[B], bool[B] -> f32[B].

    Rewards overlap at q = 0: a correct answer gets 0, the best a wrong one can get.
    """
    return weighted_brier(correct, q, format_ok, 1.0, format_penalty)


@jax.jit
def mscr(correct, q, format_ok, b1=1.0, b2=1.0, format_penalty=0.5) -> jax.Array:
    """The paper's MSCR reward. bool[B], f32[B], bool[B] -> f32[B].

    Correct answers get R in [1, 1 + b1], wrong ones R in [-b2, 0]. For a true success
    probability p the expected reward is maximized at q* = p b1 / (p b1 + (1 - p) b2).
    """
    c, q = _c_q(correct, q)
    r = c * (1.0 + b1 * (1.0 - (1.0 - q) ** 2)) - (1.0 - c) * b2 * q**2
    return _penalize(r, format_ok, format_penalty)


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
    """DAPO's overlong reward shaping (Yu et al. 2025, "DAPO", eq. 13): a response of |y|
    model-written tokens gets R_length = 0 up to L_max - L_cache, then
    (L_max - L_cache - |y|) / L_cache, falling linearly to -1 at L_max, and -1 beyond; times
    `factor`, added to the reward (`overlong_penalty`). A soft penalty over the last tokens
    before the cap instead of a cliff."""
    buffer: int = 0  # L_cache: the tokens before L_max over which the penalty ramps; 0: off
    max_tokens: int = 0  # L_max; 0: the rollout's model-token budget, (max_turns + 1) x max_response_tokens
    factor: float = 1.0  # the penalty at L_max

    def __post_init__(self):
        require(self.buffer >= 0, "buffer", self.buffer, ">= 0 (tokens over which the penalty ramps; 0: off)")
        require(self.max_tokens >= 0, "max_tokens", self.max_tokens,
                ">= 0 (0: the rollout's budget of model-written tokens)")
        require(self.factor >= 0, "factor", self.factor, ">= 0 (the penalty at the cap)")


def overlong_penalty(lengths: jax.Array, max_tokens: int, buffer: int, factor: float = 1.0) -> jax.Array:
    """DAPO's soft overlong penalty (`OverlongConfig`) of int[B] response lengths -> f32[B]:
    0 for |y| <= max_tokens - buffer, factor * (max_tokens - buffer - |y|) / buffer up to
    max_tokens, -factor beyond."""
    n = jnp.asarray(lengths, jnp.float32)
    ramp = (max_tokens - buffer - n) / max(buffer, 1)
    r = jnp.where(n <= max_tokens - buffer, 0.0, jnp.where(n <= max_tokens, ramp, -1.0))
    return (factor * r).astype(jnp.float32)


def overlong_fn(cfg: OverlongConfig, budget: int):
    """lengths int[B] -> f32[B], the penalty of `cfg` with L_max = cfg.max_tokens or `budget`
    (the rollout's model-token budget); None when shaping is off (buffer 0). Raises
    ValueError when the buffer does not fit below L_max."""
    if not cfg.buffer:
        return None
    top = cfg.max_tokens or budget
    require(cfg.buffer <= top, "overlong.buffer", cfg.buffer,
            f"<= overlong.max_tokens ({top}: the penalty ramps over the last buffer tokens before it)")
    return functools.partial(overlong_penalty, max_tokens=top, buffer=cfg.buffer, factor=cfg.factor)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Which reward and its hyperparameters. Fields a kind does not use are ignored."""

    kind: Literal["binary", "brier", "weighted_brier", "mscr"] = "mscr"
    b1: float = 1.0
    b2: float = 1.0
    weight: float = 0.5  # weighted_brier's w
    format_penalty: float = 0.5  # lambda_f
    overlong: OverlongConfig = OverlongConfig()  # DAPO's soft penalty near the length cap (training only)

    def __post_init__(self):
        require(self.kind in ("binary", "brier", "weighted_brier", "mscr"), "kind", self.kind,
                "one of binary, brier, weighted_brier, mscr")
        for f in ("b1", "b2"):
            require(getattr(self, f) > 0, f, getattr(self, f), "> 0 (mscr)")
        require(0 < self.weight <= 1, "weight", self.weight, "in (0, 1] (weighted_brier)")
        require(self.format_penalty >= 0, "format_penalty", self.format_penalty, ">= 0")


def reward_fn(cfg: RewardConfig) -> RewardFn:
    """The config's reward as a plain function (correct, q, format_ok) -> f32[B]."""
    lam = cfg.format_penalty
    if cfg.kind == "binary":
        return functools.partial(binary, format_penalty=lam)
    if cfg.kind == "brier":
        return functools.partial(brier, format_penalty=lam)
    if cfg.kind == "weighted_brier":
        return functools.partial(weighted_brier, weight=cfg.weight, format_penalty=lam)
    return functools.partial(mscr, b1=cfg.b1, b2=cfg.b2, format_penalty=lam)


def shaped_rewards(reward: RewardFn, shaping, correct: jax.Array, q: jax.Array, format_ok: jax.Array,
                   lengths: jax.Array) -> jax.Array:
    """The training reward of B rows: `reward(correct, q, format_ok)` plus `shaping` (an
    `overlong_fn`, or None: off) of int[B] model-written token counts -> f32[B]. The one
    formula the device scorer (`rl.batches.make_scorer`) and dynamic sampling's host filter
    both use."""
    rewards = reward(correct, q, format_ok)
    return rewards if shaping is None else rewards + shaping(lengths)


class RewardInputs(NamedTuple):
    """Host arrays for a reward function: correct bool[B], q float32[B], format_ok bool[B]."""

    correct: np.ndarray
    q: np.ndarray
    format_ok: np.ndarray


Task = Literal["qa", "math", "chance"]


def reward_inputs(
    responses: Sequence[pieces.Response], golds: Sequence[Sequence[str]], task: Task | Sequence[Task] = "qa",
    draws: Sequence[float] | None = None, grammar: str = "tags",
) -> RewardInputs:
    """Parses B responses against their golds. A response is an episode's pieces ((text,
    written by the model) pairs: answers and confidences come from the model's own text
    only, see `car_jax.calibration.pieces`) or a plain response string (the response part
    only, see `car_jax.calibration.parsing`). `task` is one task for all rows or one per
    row (a step may mix search questions and math problems).

    task "qa" (search agent): correct = SQuAD exact match of the last `<answer>` against any
    gold (no answer -> wrong); format_ok = the response follows `grammar`: "tags", the full
    `parsing.check_format` chain, or "qwen", Qwen's tool-call turns (`chat_format`; the
    `qwen` protocol's), see `pieces.GRAMMARS`.
    task "math" (TIR): correct = `parsing.math_equal` on the last `<answer>` if there is one,
    else on the last `\\boxed{}` (the model's, else its program's); format_ok = the confidence
    parses (the search chain does not apply to code trajectories).
    task "chance" (the positive control, `car_jax.data.chance`): the gold is (p, kind), the
    coin's success probability and its kind; the answer must name the kind (SQuAD exact
    match), as the prompt asks. correct = it does and draws[i] < p (`draws`: float[B] uniform
    in [0, 1), one per row, given by the caller from its seed); format_ok = it does and the
    confidence parses. (An answer of any other text is a format failure: were it graded,
    a policy could write a text of its own per kind before the confidence, off the prefix
    at which `experiment.control` measures E[q | kind].)
    In all, q = 0 when the confidence is missing or does not parse.
    """
    tasks = [task] * len(responses) if isinstance(task, str) else list(task)
    if not len(responses) == len(golds) == len(tasks):
        raise ValueError(f"{len(responses)} responses, {len(golds)} gold lists and {len(tasks)} tasks: "
                         f"give one of each per row")
    if "chance" in tasks and (draws is None or len(draws) != len(responses)):
        raise ValueError(f"task 'chance' grades each row with a uniform draw: give draws= one float per row "
                         f"({len(responses)}), got {None if draws is None else len(draws)}")
    correct, q, ok = [], [], []
    for i, (response, gold, kind) in enumerate(zip(responses, golds, tasks)):
        parsed = pieces.parse_pieces(response, grammar)
        if kind == "qa":
            correct.append(parsed.answer is not None and parsing.exact_match(parsed.answer, gold))
            ok.append(parsed.format_ok)
        elif kind == "math":
            answer = pieces.boxed_source(response) if parsed.answer is None else parsed.answer
            correct.append(parsing.math_equal(answer, gold))
            ok.append(parsed.confidence_ok)
        elif kind == "chance":
            if len(gold) != 2:
                raise ValueError(f"row {i}: a chance gold is (p, kind), e.g. ('0.3', 'cobalt'); got {list(gold)}")
            named = parsed.answer is not None and parsing.exact_match(parsed.answer, gold[1:])
            correct.append(named and float(draws[i]) < float(gold[0]))
            ok.append(named and parsed.confidence_ok)
        else:
            raise ValueError(f"unknown task {kind!r}: choose 'qa', 'math' or 'chance'")
        q.append(parsed.q)
    return RewardInputs(np.array(correct, bool), np.array(q, np.float32), np.array(ok, bool))
