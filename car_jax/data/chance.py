"""The positive control's task: coins whose right confidence is known exactly.

Each example names a kind of coin (`question`); the policy names the kind in its answer (so
the kind stands right before the confidence it states) and then rates the chance that the
coin lands heads. An episode that answers with the kind (no skill: the prompt names it
eight times) is graded correct with the kind's probability p, from a seeded uniform draw
per rollout row (`draws`); an episode that answers anything else, or nothing, is wrong and
fails the format. So the only thing a policy can learn is the confidence it states per
kind, and the right one is known: a proper scoring rule (Brier, MSCR with b1 = b2) is
maximised in expectation by q = p, MSCR with b1 != b2 by q* = p b1 / (p b1 + (1 - p) b2),
and the binary reward does not depend on q at all.

    load_dataset("chance")                     # KINDS x PER_KIND examples, task "chance"
    load_dataset("chance", split="extremes")   # only the kinds with p = 0.1 and 0.9 (a quick run)

A chance example's gold answers are its p, written as a decimal string, and its kind
(("0.3", "cobalt")): `calibration.rewards.reward_inputs` reads them for task "chance".
"""
from __future__ import annotations

import numpy as np

from car_jax.data.layouts import QAExample

NAME = "chance"
# (kind, p): p spans the range so that a policy stating one confidence for all kinds is far
# from calibrated (mean |q - p| >= 0.24 for any single q). Each name is one token of
# SmolLM2's vocabulary, so the kinds differ in content only, never in length (a two-token
# name was the one kind a tiny model told apart: by the prompt's length, not its words).
# Ordered so that the first two (the split "extremes": a quick run) are the two extremes.
KINDS = (("amber", 0.1), ("slate", 0.9), ("jade", 0.5), ("cobalt", 0.3), ("silver", 0.7))
PER_KIND = 40
SPLITS = {"train": KINDS, "dev": KINDS, "extremes": KINDS[:2]}  # split -> the kinds it holds
DRAW_STREAM = 20_260_311  # keeps the grading draws apart from every other use of the run seed


# How often a question names its kind. Measured on the tiny random model (2 layers, width 64)
# with SFT on informative targets (the confidence each kind deserves;
# results/control/exploration/sft_inf2, sft_inf3): named once in a 63-token prompt, 300 SFT
# steps left E[q | kind] = 0.455 for every kind (the model even answered "jade" for four kinds
# of five); named 8 times in a 37-token prompt, 150 steps reached E[q | kind] within 0.006 of
# p. A 2-layer random model reads a word that makes up a fifth of its context, not one of
# sixty tokens; the control tests the trainer, not that.
REPEATS = 8


def question(kind: str) -> str:
    return "Coin: " + " ".join([kind] * REPEATS)


def examples(kinds=KINDS, per_kind: int = PER_KIND) -> list[QAExample]:
    """per_kind examples of each (kind, p), interleaved kind by kind (so any prefix of the
    list, `data.limit`, keeps every kind); data_source "chance-<kind>" (the trainer's
    per-source metrics), one GRPO group per example."""
    out = []
    for i in range(per_kind):
        for kind, p in kinds:
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"chance kind {kind!r}: p={p} must lie in [0, 1]")
            ex_id = f"chance-{kind}-{i}"
            out.append(QAExample(id=ex_id, question=question(kind), golden_answers=(repr(float(p)), kind),
                                 data_source=f"chance-{kind}", group_id=ex_id, task="chance",
                                 meta={"kind": kind, "p": float(p)}))
    return out


def split_kinds(split: str | None) -> tuple:
    """The (kind, p) pairs of a split (`SPLITS`; None: "train")."""
    split = split or "train"
    if split not in SPLITS:
        raise ValueError(f"chance has splits {', '.join(map(repr, SPLITS))}, not {split!r}")
    return SPLITS[split]


def split_examples(split: str | None) -> list[QAExample]:
    """The examples of a split (`SPLITS`; None: "train")."""
    return examples(split_kinds(split))


def draws(seed: int, step: int, rows: int, round_: int = 0) -> np.ndarray:
    """float64[rows] uniform draws in [0, 1) that grade a training step's rows (row i is
    correct iff it answered and draws[i] < p): a function of (seed, step) only, so every
    arm of one seed sees the same draws (paired), and every process the same (it takes its
    rows' slice). `round_` > 0: a later sampling round of the step (`rl.dynamic`), with
    draws of its own."""
    key = [DRAW_STREAM, seed, step] + ([round_] if round_ else [])
    return np.random.default_rng(key).random(rows)


__all__ = ["DRAW_STREAM", "KINDS", "NAME", "PER_KIND", "REPEATS", "SPLITS", "draws", "examples", "question",
           "split_examples", "split_kinds"]
