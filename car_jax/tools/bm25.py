"""Sparse retrieval with the `bm25s` package (Lucene BM25 scoring, English stopwords).

Docs are tokenized as their whole `contents` (title line included); queries with the same
tokenizer. Query words absent from the corpus vocabulary are ignored, so an empty, foreign
or out-of-vocabulary query returns zero-score docs instead of failing.

`bm25s` is imported where it is used: importing it runs a JAX computation (its selection
module calls `jax.lax.top_k` when JAX is installed), which starts the XLA backend, and a
multi-process run must call `jax.distributed.initialize` before that happens. Its logger,
which it sets to DEBUG on import (a "Building index" line on every run), is set back to
WARNING.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever

BM25_DIR = "bm25"


@dataclasses.dataclass(frozen=True)
class BM25Options:
    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    stopwords: str = "en"


def _bm25s():
    import bm25s
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


def _tokenize(texts: list[str], options: BM25Options, as_ids: bool, progress: bool = False):
    return _bm25s().tokenize(
        texts, stopwords=options.stopwords, return_ids=as_ids, show_progress=progress
    )


def build_bm25(texts: list[str], options: BM25Options, progress: bool = True):
    """Corpus texts [N] -> a fitted bm25s.BM25."""
    model = _bm25s().BM25(k1=options.k1, b=options.b, method=options.method)
    model.index(_tokenize(texts, options, as_ids=True, progress=progress), show_progress=progress)
    return model


def save_bm25(model, folder: str | Path) -> None:
    model.save(str(Path(folder) / BM25_DIR), show_progress=False)


def load_bm25(folder: str | Path):
    path = Path(folder) / BM25_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"no BM25 index at {path}; build one with `car-jax build-index --backend bm25`"
        )
    return _bm25s().BM25.load(str(path), show_progress=False)


class BM25Retriever(Retriever):
    """bm25s model + doc store (rows of the store = doc ids of the model)."""

    def __init__(self, model, store: Sequence[Doc], options: BM25Options = BM25Options()):
        self.model, self.store, self.options = model, store, options

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        tokens = _tokenize(queries, self.options, as_ids=False)
        rows, scores = self.model.retrieve(
            tokens, k=min(topk, len(self.store)), show_progress=False, n_threads=1
        )  # [B, k] each
        return [
            [dataclasses.replace(self.store[int(r)], score=float(s)) for r, s in zip(rr, ss)]
            for rr, ss in zip(rows, scores)
        ]

    def close(self) -> None:
        if hasattr(self.store, "close"):
            self.store.close()
