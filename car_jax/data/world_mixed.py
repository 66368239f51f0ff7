"""The mixed splits of the large world (`world_large`): search questions and arithmetic word
problems interleaved, for one policy that uses both tools (the `mixed` prompt and protocol).

    load_dataset("world-large", split="mixed_train" | "mixed_dev")

Each split alternates a search question (a row of the QA split: single, two_hop, hidden or
absent, in that split's proportions) and a word problem (a row of the arithmetic split), so
any prefix (`limit`) holds both kinds evenly:
    mixed_train   400 questions of train + 400 problems of arith_train
    mixed_dev     100 questions of dev   + 100 problems of arith_dev
Drawn from the single-tool splits (car_jax's decision), not generated anew: a mixed question
is the same question the single-tool cells ask, so the pilot compares a tool's questions with
and without the other tool at hand, and mixed_dev shares nothing with train or mixed_train.
Rows keep their split's columns (QA: question, golden_answers; arithmetic: problem, answer, op,
so `load_dataset` gives task "qa" or "math" per row) plus `tool` ("search" or "code": which
tool the row needs, for per-kind reports) and `source_id` (the row's id in its own split).
The draw uses its own `random.Random`, seeded from the world's seed, so adding these splits
left the other files as they were.
"""
from __future__ import annotations

import json
import random

# split -> (its QA split, its arithmetic split, rows taken from each)
MIXED = {"mixed_train": ("train", "arith_train", 400), "mixed_dev": ("dev", "arith_dev", 100)}
TOOLS = ("search", "code")  # the `tool` of a QA row, of an arithmetic row


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mixed_files(seed: int, files: dict[str, str], name: str) -> dict[str, str]:
    """{"<split>.jsonl": JSONL text} for every split of MIXED, from the world's other files
    (`files`: {"train.jsonl": text, ...}); a pure function of `seed` and those files. Row ids:
    "<name>-<split>-<index>"."""
    rng = random.Random(f"{seed}:mixed")
    out = {}
    for split, (qa, arith, n) in MIXED.items():
        picked = [rng.sample(_rows(files[f"{source}.jsonl"]), n) for source in (qa, arith)]
        rows = [dict(row, id=f"{name}-{split}-{2 * i + j:04d}", tool=TOOLS[j], source_id=row["id"])
                for i, pair in enumerate(zip(*picked)) for j, row in enumerate(pair)]
        out[f"{split}.jsonl"] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return out
