"""Evidence noise, for experiments on how noisy search shapes calibration (the paper's pilot
study: evidence tools and over-confidence).

`NoisyRetriever` wraps any retriever and perturbs each query's doc list, in this order:
1. replace: each doc, with probability `replace_rate`, becomes a distractor drawn uniformly
   from `distractors` (a doc store or any sequence of Docs), not already in the list; it keeps
   the replaced doc's score, so scores do not give it away;
2. drop: each doc is removed with probability `drop_rate` (a row may end up empty);
3. shuffle: with probability `shuffle_rate` the row's order is permuted.
Randomness comes from one numpy Generator seeded with `seed`, drawn in call order under a
lock: the same sequence of `search` calls gives the same noise.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import numpy as np

from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever


@dataclasses.dataclass(frozen=True)
class NoiseConfig:
    drop_rate: float = 0.0
    shuffle_rate: float = 0.0
    replace_rate: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("drop_rate", "shuffle_rate", "replace_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"NoiseConfig.{name} must be in [0, 1], got {value}")

    @property
    def active(self) -> bool:
        return bool(self.drop_rate or self.shuffle_rate or self.replace_rate)


class NoisyRetriever(Retriever):
    def __init__(self, base: Retriever, config: NoiseConfig, distractors: Sequence[Doc] = ()):
        if config.replace_rate and not len(distractors):
            raise ValueError("NoiseConfig.replace_rate > 0 needs a distractor pool (e.g. the doc store)")
        self.base, self.config, self.distractors = base, config, distractors
        self._rng = np.random.default_rng(config.seed)
        self._lock = threading.Lock()

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        results = self.base.search(queries, topk)
        with self._lock:
            return [self._perturb(list(docs)) for docs in results]

    def _perturb(self, docs: list[Doc]) -> list[Doc]:
        cfg, rng = self.config, self._rng
        if cfg.replace_rate:
            for i, doc in enumerate(docs):
                if rng.random() < cfg.replace_rate:
                    docs[i] = dataclasses.replace(self._distractor({d.id for d in docs}), score=doc.score)
        if cfg.drop_rate:
            docs = [d for d in docs if rng.random() >= cfg.drop_rate]
        if cfg.shuffle_rate and rng.random() < cfg.shuffle_rate:
            docs = [docs[i] for i in rng.permutation(len(docs))]
        return docs

    def _distractor(self, taken: set[str]) -> Doc:
        for _ in range(8):  # avoid duplicates in the row; give up quietly on tiny pools
            doc = self.distractors[int(self._rng.integers(len(self.distractors)))]
            if doc.id not in taken:
                break
        return doc

    def close(self) -> None:
        self.base.close()
