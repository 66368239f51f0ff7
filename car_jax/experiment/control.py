"""The positive control: can the trainer learn a confidence whose right value is known?

On the chance task (`car_jax.data.chance`) an episode that names the prompt's coin kind is
graded correct with the kind's probability p (any other answer is wrong and fails the
format), so the confidence is all a policy can learn, and the reward says what it should
learn: q*(p) = p for Brier and for MSCR with b1 = b2, p b1 / (p b1 + (1 - p) b2)
for MSCR with b1 != b2, and nothing for the binary reward (it does not depend on q).

Every unit is a plain `car-jax train` run folder under `out`, through the real trainer
(tokenizer, episodes, loss mask, group advantages, rewards, optimizer, checkpoints):

    warm-s{seed}     the SFT warm start alone (rl.steps=0): the layout, with uniform random
                     stated confidences, so the starting policy knows nothing about the kinds
    {arm}-s{seed}    GRPO from warm-s{seed}'s export with the arm's reward and no SFT of its
                     own (overrides reach every unit; `sft.steps` sets the warm start's alone);
                     seed s also orders the data (data.shuffle_seed) and draws the grading
                     (`chance.draws`), so the arms of one seed share one start and see the same
                     prompts and the same coin tosses

A finished unit is skipped and a stopped one resumes from its checkpoints. Each policy is
then measured exactly: its expected confidence E[q | kind] from its next-token distribution
over every value 0..100 after `<answer> KIND </answer>\\n<confidence>` (`rl.confidence`),
written to the unit's `control.json`. `report` gathers them into out/control.json, a table
(out/CONTROL.md) and a figure of E[q | kind] per step (out/control.png; the per-step values
are the sampled confidences of that step's rollouts, `q/chance-<kind>` in metrics.jsonl).

Criterion (issue acceptance): an arm with a target learns it when, in every seed, the mean
over kinds of |E[q | kind] - q*| is <= TOLERANCE and the policy still answers every kind in
the format (P(answer prefix) >= ANSWER_MIN: E[q | kind] is measured after that prefix, so a
kind the policy no longer answers has a confidence it never states); the binary arm is
measured against p.
"""
from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure

from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.checkpoints.sources import check_model_path
from car_jax.config import load_config
from car_jax.data import chance
from car_jax.data.prompts import make_prompt
from car_jax.experiment.stats import paired_t
from car_jax.loading import load_model, load_tokenizer
from car_jax.rl.confidence import expected_q, value_distribution
from car_jax.rollout.generate import prompt_texts
from car_jax.train.config import TrainConfig
from car_jax.train.trainer import train

TOLERANCE = 0.1  # mean over kinds of |E[q | kind] - q*|
ANSWER_MIN = 0.5  # a kind the policy answers in the format with less probability than this is lost
RESPONSE_PREFIX = "<answer> {kind} </answer>\n<confidence>"  # what the demonstrations write before the value
TAIL = " {} </confidence>"
UNIT_FILE, REPORT_FILE, TABLE_FILE, PLOT_FILE = "control.json", "control.json", "CONTROL.md", "control.png"


@dataclasses.dataclass(frozen=True)
class Arm:
    """A reward and its hyperparameters, the advantage normalisation, and optionally a batch of
    its own (prompts a step and trajectories an update; None: the design's), as config overrides."""
    name: str
    kind: str
    b1: float = 1.0
    b2: float = 1.0
    std_norm: bool = False  # GRPO's division by the group's reward std (rl.adv_std_norm)
    prompts_per_step: int | None = None  # rl.prompts_per_step
    mini_batch: int | None = None  # rl.mini_batch

    @property
    def overrides(self) -> list[str]:
        own = [f"rl.{key}={getattr(self, key)}" for key in ("prompts_per_step", "mini_batch")
               if getattr(self, key) is not None]
        return [f"reward.kind={self.kind}", f"reward.b1={self.b1}", f"reward.b2={self.b2}",
                f"rl.adv_std_norm={str(self.std_norm).lower()}", *own]

    def target(self, p: float) -> float:
        """q*(p): the stated confidence that maximises the arm's expected reward (binary: any
        q does; p is what it is measured against)."""
        if self.kind == "mscr":
            return p * self.b1 / (p * self.b1 + (1.0 - p) * self.b2)
        return p


# The arms of `run_control`'s default run, and one more (brier_std) that keeps GRPO's std
# normalisation. Without it the advantage r - mean(r) is the plain policy gradient of the
# expected reward, whose maximiser is q*; dividing by the group's std re-weights groups by
# how alike their rewards are: a group that is all wrong (or all right) differs only by its
# confidences, its std is small, and its advantages of +-1 push q to 0 (or 1) as hard as a
# mixed group's push it toward p. brier_std measures what that does. mscr_wide is MSCR with
# 2.5x the trajectories in each of the same number of optimizer updates (25 prompts a step in
# mini-batches of 100, against 10 and 40): at b1 = b2, MSCR = Brier + c, and the extra c, which
# does not depend on q within a group, adds variance to the estimate of q's gradient and
# nothing to its mean (results/control_five_long/gradient_noise.txt); it costs 2.5x the
# sampling and update time of an arm. mscr_b1_2 is the other b1 != b2 arm: q* = 2p / (1 + p) =
# 0.18, 0.46, 0.67, 0.82, 0.95, every one above 0.1, where mscr_b2_3's q* for three kinds
# (0.125, 0.25, 0.44) sit close enough to amber's one-digit values that its seed 0 wrote all
# three with one digit (results/control_five_long).
ARMS = {a.name: a for a in (Arm("binary", "binary"), Arm("brier", "brier"), Arm("mscr", "mscr"),
                            Arm("mscr_b2_3", "mscr", 1.0, 3.0), Arm("brier_std", "brier", std_norm=True),
                            Arm("mscr_wide", "mscr", prompts_per_step=25, mini_batch=100),
                            Arm("mscr_b1_2", "mscr", 2.0, 1.0))}
DEFAULT_ARMS = ("binary", "brier", "mscr", "mscr_b2_3")

# The design, as `car-jax train` overrides (every key is a TrainConfig key); the single-seed
# runs that chose it are in results/control/exploration/. The warm start: 400 SFT steps of 16
# demonstrations at lr 3e-3 (its loss plateaus at the entropy of the random confidences; after
# 150 steps the sampled answers named the wrong kind for about half the rows of three kinds).
# GRPO: 10 prompts x 16 trajectories a step in 4 mini-batches of 40, lr 1e-3 decayed by a
# cosine to 5% over the arm's run. The history: at 8 trajectories and a constant 2e-3, 2 of 5
# seeds of the two-kind control broke the format and others lost the kinds they had separated
# (results/control_extremes); a cosine decay kept the format, but in seed 2 the sampled
# confidences of every calibration arm collapsed onto one value per kind early (within-group
# SD of q 0.28 -> 0.07), far from q*, and stayed there (results/control_extremes_cosine, 3
# seeds); with twice the trajectories a step at half the lr, the same seed reached q*
# (exploration/extremes_s2_g16_lr1e-3). 5e-3 broke the format within 10 steps. A small KL to
# the warm start (0.01: without one the confidences collapsed onto one value for every kind);
# temperature 1 and top_p 1, so the sampled confidences follow the policy's own distribution.
BASE = ["model.path=builtin:tiny-random", "mesh.devices=1", "data.train=chance", "data.template=chance",
        "rollout.group_size=16", "rollout.max_turns=0", "rollout.max_response_tokens=24",
        "rollout.temperature=1.0", "rollout.top_p=1.0",
        "sft.data=chance", "sft.steps=400", "sft.batch=16", "sft.lr=3e-3",
        "rl.prompts_per_step=10", "rl.mini_batch=40", "rl.loss.kl_coef=0.01", "rl.loss.entropy_coef=0.0",
        "rl.optim.lr=1e-3", "rl.optim.schedule=cosine", "rl.optim.min_lr_ratio=0.05", "rl.optim.warmup_steps=0",
        "rl.optim.grad_clip=1.0",
        "run.checkpoint_every=50", "run.keep=1", "run.tensorboard=false", "run.export_hf=true"]


@dataclasses.dataclass(frozen=True)
class Budget:
    """A split's GRPO run per arm: its steps and its peak learning rate (rl.optim.lr)."""
    steps: int
    lr: float


# The two extreme kinds: 60 steps at 1e-3 (above; 5 of 5 seeds, results/control_extremes_g16).
# All five kinds need more: at 150 steps (1e-3) or 300 (5e-4), seed 0's Brier arm learned
# amber alone (error 0.137, 0.126; results/control_five_named, exploration/); 300 steps at 1e-3
# broke the format in one update at step 13 (exploration/five_s0_300steps_lr1e-3); 600 steps
# at 5e-4, whose cosine keeps the rate up for longer, separated the other four kinds from
# step 220 on (exploration/five_s0_600steps_lr5e-4). At 600 steps Brier passed in 3 of 4 seeds
# and MSCR missed in its one (results/control_five_long), the misses with the upper kinds pooled
# on one value; 1,200 steps (the cosine over twice the updates) took both misses inside the
# tolerance, Brier seed 3 from 0.102 to 0.038 and MSCR seed 0 from 0.104 to 0.075
# (exploration/five_1200steps), so the five kinds get 1,200.
BUDGETS = {"extremes": Budget(60, 1e-3), "train": Budget(1200, 5e-4), "dev": Budget(1200, 5e-4)}
STEPS = BUDGETS["train"].steps
# The quick version (`run_quick`, `car-jax control --quick`, tests/test_control.py): the design
# itself on the two extreme kinds, Brier against binary, seed 0, 60 steps (about 9 minutes on
# two cores). A cheaper setting (8 trajectories at lr 2e-3) was the quick version before: it
# collapsed in 1 of 3 seeds of results/control_extremes_cosine, and again in the test suite,
# whose XLA flags change the floating-point path enough to act as another seed. The design
# passed 5 of 5 seeds (results/control_extremes_g16).
QUICK_ARMS, QUICK_SEEDS, QUICK_SPLIT = ("brier", "binary"), (0,), "extremes"
QUICK_STEPS = BUDGETS[QUICK_SPLIT].steps  # 60


def warm_config(out: Path, seed: int, overrides: Sequence[str] = ()) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE, f"seed={seed}", f"data.shuffle_seed={seed}", "rl.steps=0",
                                           f"run.dir={out / f'warm-s{seed}'}", *overrides])


def arm_config(out: Path, arm: Arm, seed: int, steps: int, overrides: Sequence[str] = ()) -> TrainConfig:
    """GRPO from warm-s{seed}'s export. The overrides apply as to the warm start, but the arm
    runs no SFT of its own (the warm start is the seed's one SFT), and its learning-rate
    schedule spans its whole run: rl.optim.total_steps counts optimizer updates, which is
    `steps` x the mini-batches of a step x rl.epochs."""
    warm = out / f"warm-s{seed}" / "hf"
    args = [*BASE, f"seed={seed}", f"data.shuffle_seed={seed}", f"model.path={warm}", f"rl.steps={steps}",
            *arm.overrides, f"run.dir={out / f'{arm.name}-s{seed}'}", *overrides, "sft.steps=0"]
    cfg = load_config(TrainConfig, None, args)
    rows = cfg.rl.prompts_per_step * cfg.rollout.group_size
    updates = steps * (rows // (cfg.rl.mini_batch or rows)) * cfg.rl.epochs
    return load_config(TrainConfig, None, [*args, f"rl.optim.total_steps={updates}"])


def finished(cfg: TrainConfig) -> bool:
    """Whether the run folder holds a complete run of cfg (its last step and its export)."""
    run = Path(cfg.run.dir)
    try:
        done = json.loads((run / "last_step.json").read_text())["step"] == cfg.rl.steps
    except (OSError, ValueError, KeyError):
        return False
    return done and (run / "hf" / "config.json").is_file()


def kind_parts(tokenizer, kinds=chance.KINDS) -> list[tuple[list[int], list[int]]]:
    """For each kind: (its prompt, chat template applied; the response up to the confidence
    value), as token ids, tokenized the way the demonstrations are (prompt, then the response
    text on its own)."""
    exs = {ex.meta["kind"]: ex for ex in chance.examples(kinds, 1)}
    texts = prompt_texts(tokenizer, [make_prompt(exs[kind], "chance") for kind, _ in kinds])
    return [(tokenizer(t, add_special_tokens=False)["input_ids"],
             tokenizer(RESPONSE_PREFIX.format(kind=kind), add_special_tokens=False)["input_ids"])
            for t, (kind, _) in zip(texts, kinds)]


def kind_prefixes(tokenizer, kinds=chance.KINDS) -> list[list[int]]:
    """For each kind: its prompt and the response up to the confidence value, as one list of
    token ids (`kind_parts` joined)."""
    return [prompt + response for prompt, response in kind_parts(tokenizer, kinds)]


def answer_probability(model, tokenizer, kinds=chance.KINDS) -> np.ndarray:
    """float64[K]: for each kind, the probability that `model` (a `loading.Model`), sampling
    at the design's temperature 1, writes the response prefix (`<answer> KIND </answer>` and
    the confidence tag) right after the kind's prompt: the product of its tokens'
    probabilities, teacher-forced in one right-padded batch. E[q | kind] is measured after
    that prefix, so it is the policy's own confidence only where the policy writes it; a
    policy that has stopped naming a kind (the format lost for that kind) has an E[q | kind]
    it never states."""
    parts = kind_parts(tokenizer, kinds)
    width = max(len(p) + len(r) for p, r in parts)
    tokens = np.zeros((len(parts), width), np.int32)
    for i, (p, r) in enumerate(parts):
        tokens[i, :len(p) + len(r)] = p + r
    logits = np.asarray(model.logits(tokens), np.float64)  # [K, T, V]; padding is after every prefix
    out = []
    for row, (p, r) in zip(logits, parts):
        at = row[len(p) - 1:len(p) + len(r) - 1]  # the positions that predict the response's tokens
        top = at.max(axis=-1, keepdims=True)
        logp = at - top - np.log(np.exp(at - top).sum(axis=-1, keepdims=True))
        out.append(np.exp(logp[np.arange(len(r)), r].sum()))
    return np.asarray(out)


def measure(model, tokenizer, kinds=chance.KINDS) -> dict[str, dict]:
    """kind -> {"expected_q": E[q | kind], "mode": the most likely value / 100, "one_digit":
    P(value < 10), "answers": P(the policy writes the answer naming the kind, up to the
    confidence tag), "distribution": P(value) for value 0..100} of `model` (a
    `loading.Model`), from its distribution at the confidence tag. "one_digit" is the mass on
    values written with one digit (q < 0.1): a policy that states no second digit can only
    reach q = 0.09, whatever its target. "answers" (`answer_probability`) says whether E[q |
    kind] is what the policy states: below ANSWER_MIN the kind's format is lost. The
    distribution (to 1e-7) is kept so that later questions about a unit need no weights:
    they are not committed."""
    dist = value_distribution(model, tokenizer, kind_prefixes(tokenizer, kinds), TAIL)
    means = expected_q(dist)
    answers = answer_probability(model, tokenizer, kinds)
    return {kind: {"expected_q": float(m), "mode": float(np.argmax(d)) / 100.0, "one_digit": float(np.sum(d[:10])),
                   "answers": float(a), "distribution": [round(float(x), 7) for x in d]}
            for (kind, _), m, d, a in zip(kinds, means, np.asarray(dist), answers)}


def _measure_unit(run_dir: Path) -> dict:
    path = run_dir / "hf"
    result = measure(load_model(path, progress=False), load_tokenizer(path))
    (run_dir / UNIT_FILE).write_text(json.dumps(result, indent=1))
    return result


def run_control(out: str | Path, *, arms: Sequence[str] = DEFAULT_ARMS, seeds: Sequence[int] = range(5),
                steps: int | None = None, split: str = "train", overrides: Sequence[str] = (),
                log: Callable[[str], None] = print) -> dict:
    """Runs (or resumes) every unit, seed by seed, measures each policy, writes the report;
    returns it (`report`). `split`: the chance split the runs train on ("train": every kind;
    "extremes": p = 0.1 and 0.9 only, a quick run), which the report scores; `steps` (None:
    the split's) and the peak lr come from the split's `BUDGETS`; `overrides` go to every
    unit's config after them (e.g. a smaller sft.steps, another rl.optim.lr)."""
    out = Path(out)
    kinds = chance.split_kinds(split)
    budget = BUDGETS[split]
    steps = steps or budget.steps
    overrides = [f"data.train_split={split}", f"rl.optim.lr={budget.lr}", *overrides]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r}: choose from {', '.join(ARMS)}")
    configs = [(f"warm-s{s}", warm_config(out, s, overrides), [(a, arm_config(out, ARMS[a], s, steps, overrides))
                                                               for a in arms]) for s in seeds]
    for warm_name, warm, runs in configs:
        for name, cfg in [(warm_name, warm), *runs]:
            run_dir = Path(cfg.run.dir)
            if finished(cfg) and (run_dir / UNIT_FILE).is_file():
                continue
            start = time.perf_counter()
            if not finished(cfg):
                if cfg.rl.steps > 0:
                    _check_weights(Path(cfg.model.path), warm_name)
                log(f"== {name}: {'SFT warm start' if cfg.rl.steps == 0 else f'{cfg.rl.steps} GRPO steps'} ==")
                train(cfg)
            _measure_unit(run_dir)
            log(f"{name}: done in {time.perf_counter() - start:.0f} s")
    return report(out, arms=arms, seeds=seeds, kinds=kinds)


def _check_weights(export: Path, warm_name: str) -> None:
    """An arm trains from its warm start's export: refuse, naming the fix, when the warm start's
    records are there but its weights are not (the records are committed, the weights not)."""
    if not (export / "config.json").is_file():  # not exported yet: the warm start's run reports that
        return
    try:
        check_model_path(export)
    except CheckpointError as err:
        raise FileNotFoundError(
            f"{warm_name} has its records but not its weights ({err}), and an arm of its seed still "
            f"has to train from them; remove {export.parent} to re-run its SFT (the seed's finished "
            f"arms then came from the earlier warm start, with the same data order)") from None


def run_quick(out: str | Path, *, steps: int = QUICK_STEPS, log: Callable[[str], None] = print) -> dict:
    """The quick version of the control (see QUICK_ARMS): run or resume it, report it."""
    return run_control(out, arms=QUICK_ARMS, seeds=QUICK_SEEDS, steps=steps, split=QUICK_SPLIT, log=log)


# ---------------------------------------------------------------- the report
def _nanmean(values, axis=None) -> np.ndarray:
    """np.nanmean, NaN (without numpy's warning) where a step had no prompt of a kind in any seed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(np.nanmean(values, axis=axis))


def _curve(run_dir: Path, kinds) -> dict[str, list[float]]:
    """Per-step mean sampled q of each kind (`q/chance-<kind>` in metrics.jsonl); NaN where a
    step had no prompt of that kind."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {kind: [float(r.get(f"q/chance-{kind}", float("nan"))) for r in rows] for kind, _ in kinds}


def report(out: str | Path, *, arms: Sequence[str] = DEFAULT_ARMS, seeds: Sequence[int] = range(5),
           kinds=chance.KINDS) -> dict:
    """Gathers the finished units' measurements under `out` into out/control.json, the
    table out/CONTROL.md and the figure out/control.png; returns the report dict:

        {"kinds": {kind: p}, "tolerance": TOLERANCE,
         "warm": {seed: {kind: E[q]}},
         "arms": {arm: {"target": {kind: q*}, "seeds": {seed: {kind: E[q]}},
                        "error": {seed: mean_k |E[q] - q*|}, "learned": bool | None,
                        "curve": {kind: [per-step mean over seeds]},
                        "error_vs_p": {seed: mean_k |E[q] - p|}, (arms whose q* is not p)
                        "one_digit": {seed: {kind: P(value < 10)}}, (units measured with it)
                        "paired": {name: stats.paired_t}}}}

                        "answers": {seed: {kind: P(answer prefix)}}, (units measured with it)
                        "lost": {seed: [kinds answered with P < ANSWER_MIN]},
                        "passed": {seed: error <= TOLERANCE and no kind lost},

    "learned" is True when every seed passed, None while units are missing.
    "paired" compares errors seed by seed (the seeds both sides have, at least 2; the arms of
    a seed share its warm start, prompts and coin tosses): "binary", the arm's error minus
    the binary arm's (each against its own reference: q*, or p for binary); "p", for an arm
    whose q* is not p, its error against q* minus its error against p (below 0: it sits
    nearer its own optimum than the one b1 = b2 would have)."""
    out = Path(out)
    ps = {kind: p for kind, p in kinds}
    rep = {"kinds": ps, "tolerance": TOLERANCE, "warm": {}, "arms": {}}
    for s in seeds:
        unit = out / f"warm-s{s}" / UNIT_FILE
        if unit.is_file():
            rep["warm"][str(s)] = {k: v["expected_q"] for k, v in json.loads(unit.read_text()).items() if k in ps}
    for name in arms:
        arm = ARMS[name]
        target = {kind: arm.target(p) for kind, p in kinds}
        entry = {"target": target, "seeds": {}, "error": {}, "curve": {}}
        curves = []
        for s in seeds:
            unit = out / f"{name}-s{s}" / UNIT_FILE
            if not unit.is_file():
                continue
            measured = {k: v for k, v in json.loads(unit.read_text()).items() if k in ps}
            got = {k: v["expected_q"] for k, v in measured.items()}
            entry["seeds"][str(s)] = got
            for key in ("one_digit", "answers"):  # units measured before a key existed lack it
                if all(key in v for v in measured.values()):
                    entry.setdefault(key, {})[str(s)] = {k: v[key] for k, v in measured.items()}
            entry["error"][str(s)] = float(np.mean([abs(got[k] - target[k]) for k in target]))
            curves.append(_curve(out / f"{name}-s{s}", kinds))
        entry["lost"] = {seed: [k for k in ps if a[k] < ANSWER_MIN] for seed, a in entry.get("answers", {}).items()}
        entry["passed"] = {seed: e <= TOLERANCE and not entry["lost"].get(seed) for seed, e in entry["error"].items()}
        complete = len(entry["seeds"]) == len(seeds)
        entry["learned"] = all(entry["passed"].values()) if complete else None
        if curves:
            n = min(len(c[k]) for c in curves for k in c)
            entry["curve"] = {kind: _nanmean([c[kind][:n] for c in curves], axis=0).tolist() for kind, _ in kinds}
        if any(target[k] != ps[k] for k in ps):
            entry["error_vs_p"] = {s: float(np.mean([abs(got[k] - ps[k]) for k in ps]))
                                   for s, got in entry["seeds"].items()}
        rep["arms"][name] = entry
    for name, entry in rep["arms"].items():
        entry["paired"] = {}
        if name != "binary" and "binary" in rep["arms"]:
            entry["paired"]["binary"] = _paired(entry["error"], rep["arms"]["binary"]["error"])
        if "error_vs_p" in entry:
            entry["paired"]["p"] = _paired(entry["error"], entry["error_vs_p"])
        entry["paired"] = {k: v for k, v in entry["paired"].items() if v is not None}
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(rep, indent=1))
    (out / TABLE_FILE).write_text(format_report(rep) + "\n")
    if any(a["curve"] for a in rep["arms"].values()):
        plot_report(rep, out / PLOT_FILE)
    return rep


def _paired(arm: dict, base: dict) -> dict | None:
    """paired_t of two {seed: value} maps over the seeds both have; None below 2 such seeds."""
    seeds = sorted(set(arm) & set(base), key=int)
    if len(seeds) < 2:
        return None
    return {**paired_t([arm[s] for s in seeds], [base[s] for s in seeds]), "seeds": seeds}


def format_report(rep: dict) -> str:
    """The report as a markdown table: per arm, E[q | kind] (mean over seeds) against q*,
    and the per-seed error (mean over kinds of |E[q | kind] - q*|)."""
    kinds = sorted(rep["kinds"], key=rep["kinds"].get)
    head = "| policy | " + " | ".join(f"{k} (p={rep['kinds'][k]:g})" for k in kinds) + \
        " | error per seed (seed: error) | seeds <= {:g}, format kept |".format(rep["tolerance"])
    lines = [head, "|" + "---|" * (len(kinds) + 3)]
    if rep["warm"]:
        warm = rep["warm"]
        errs = {s: np.mean([abs(w[k] - rep["kinds"][k]) for k in kinds]) for s, w in warm.items()}
        cells = [f"{np.mean([w[k] for w in warm.values()]):.3f}" for k in kinds]
        lines.append(f"| warm start (vs p) | {' | '.join(cells)} | {_seed_errs(errs)} | "
                     f"{sum(e <= rep['tolerance'] for e in errs.values())} of {len(errs)} |")
    for name, a in rep["arms"].items():
        if not a["seeds"]:
            lines.append(f"| {name} | " + " | ".join("-" for _ in kinds) + " | (not run) | |")
            continue
        label = "p" if ARMS[name].kind == "binary" else "q*"  # binary has no q*: it is measured against p
        cells = [f"{np.mean([s[k] for s in a['seeds'].values()]):.3f} ({label} {a['target'][k]:.3f})" for k in kinds]
        lines.append(f"| {name} | {' | '.join(cells)} | {_seed_errs(a['error'])} | "
                     f"{sum(a['passed'].values())} of {len(a['passed'])} |")
    held = lambda a, got, k: got[k] >= 0.5 and a["target"][k] > 0.1  # noqa: E731 (one digit states at most 0.09)
    trapped = [f"{name} seed {seed}: {', '.join(k for k in kinds if held(a, got, k))}"
               for name, a in rep["arms"].items() if ARMS[name].kind != "binary"
               for seed, got in a.get("one_digit", {}).items() if any(held(a, got, k) for k in kinds)]
    if trapped:
        lines += ["", "Kinds whose q* is above 0.1 but whose policy puts half its mass or more on one-digit values "
                  "(at most 0.09; P(value < 10) in each unit's control.json): " + "; ".join(trapped) + "."]
    lost = [f"{name} seed {seed}: " + ", ".join(f"{k} ({a['answers'][seed][k]:.3f})" for k in ks)
            for name, a in rep["arms"].items() for seed, ks in a.get("lost", {}).items() if ks]
    if lost:
        lines += ["", f"Kinds the policy no longer answers in the format (P(it writes the answer naming the kind) "
                  f"< {ANSWER_MIN:g}: their E[q | kind] is never stated, and the seed does not pass): "
                  + "; ".join(lost) + "."]
    unchecked = [(name, [seed for seed in a["seeds"] if seed not in a.get("answers", {})])
                 for name, a in rep["arms"].items()]
    unchecked = [f"{name} (seed{'s' if len(ss) > 1 else ''} {', '.join(ss)})" for name, ss in unchecked if ss]
    if unchecked:
        lines += ["", "Measured before P(answer) was (format not checked, the error alone decides): "
                  + ", ".join(unchecked) + "."]
    paired = [(name, key, d) for name, a in rep["arms"].items() for key, d in a.get("paired", {}).items()]
    if paired:
        lines += ["", "Paired by seed (the difference of the errors, mean and 95% t interval over the seeds):", "",
                  "| comparison | seeds | per seed | mean [95% interval] |", "|---|---|---|---|"]
        what = {"binary": "{name} - binary", "p": "{name}: error against q* - against p"}
        for name, key, d in paired:
            lines.append(f"| {what[key].format(name=name)} | {', '.join(d['seeds'])} | {_errs(d['per_seed'])} | "
                         f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] |")
    return "\n".join(lines)


def _seed_errs(errs: dict) -> str:
    return ", ".join(f"{s}: {e:.3f}" for s, e in errs.items())


def _errs(errs) -> str:
    return ", ".join(f"{e:.3f}" for e in errs)


def plot_report(rep: dict, path: str | Path, window: int = 10) -> Path:
    """One panel per arm: the sampled E[q | kind] per step (mean over seeds, running mean
    over `window` steps), each kind's q* dashed, and the final exact E[q | kind] (mean over
    seeds) as a dot at the right edge."""
    arms = [(n, a) for n, a in rep["arms"].items() if a["curve"]]
    fig = Figure(figsize=(4.0 * len(arms), 3.6), dpi=110)
    axes = np.atleast_1d(fig.subplots(1, len(arms), sharey=True))
    colors = {k: f"C{i}" for i, k in enumerate(sorted(rep["kinds"], key=rep["kinds"].get))}
    for ax, (name, a) in zip(axes, arms):
        for kind, ys in a["curve"].items():
            ys = np.asarray(ys, float)
            smooth = np.array([_nanmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))])
            steps = np.arange(1, len(ys) + 1)
            ax.plot(steps, smooth, color=colors[kind], lw=1.5, label=f"{kind} (p={rep['kinds'][kind]:g})")
            ax.axhline(a["target"][kind], color=colors[kind], ls="--", lw=0.8)
            final = np.mean([s[kind] for s in a["seeds"].values()])
            ax.plot([len(ys)], [final], "o", color=colors[kind], ms=5)
        n = len(a['seeds'])
        ax.set(title=f"{name} ({n} seed{'s' if n != 1 else ''})", xlabel="GRPO step", ylim=(0, 1))
    axes[0].set_ylabel("E[q | kind]  (dashed: q*)")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


__all__ = ["ANSWER_MIN", "ARMS", "Arm", "BASE", "BUDGETS", "Budget", "DEFAULT_ARMS", "QUICK_ARMS", "QUICK_SEEDS",
           "QUICK_SPLIT", "QUICK_STEPS", "STEPS", "TOLERANCE", "answer_probability", "arm_config", "format_report",
           "measure", "report", "run_control", "run_quick", "warm_config"]
