"""Dense retrieval: a FAISS inner-product index over L2-normalized encoder embeddings.

Index kinds (`IndexOptions.kind`): "flat" (exact, the default, Search-R1's `e5_Flat.index`),
"ivf" (inverted lists; trained on the first `train_size` embeddings; `nprobe` lists searched)
and "hnsw" (graph; `hnsw_m` links, `ef_search` at query time). Since embeddings are unit
vectors, inner product = cosine similarity.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np

from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever

INDEX_FILE = "index.faiss"


@dataclasses.dataclass(frozen=True)
class IndexOptions:
    kind: str = "flat"  # "flat" | "ivf" | "hnsw"
    nlist: int = 1024  # ivf: number of inverted lists (capped by the corpus size)
    nprobe: int = 32  # ivf: lists searched per query
    hnsw_m: int = 32  # hnsw: links per node
    ef_search: int = 128  # hnsw: candidate list size at query time
    train_size: int = 200_000  # ivf: embeddings used for k-means

    def __post_init__(self):
        if self.kind not in ("flat", "ivf", "hnsw"):
            raise ValueError(f"index kind {self.kind!r} unknown; use 'flat', 'ivf' or 'hnsw'")

    def factory(self, num_docs: int) -> str:
        """The faiss.index_factory string for a corpus of `num_docs`."""
        if self.kind == "ivf":
            return f"IVF{max(1, min(self.nlist, num_docs // 39 or 1))},Flat"
        if self.kind == "hnsw":
            return f"HNSW{self.hnsw_m}"
        return "Flat"

    def search_params(self) -> dict:
        return {"ivf": {"nprobe": self.nprobe}, "hnsw": {"efSearch": self.ef_search}}.get(self.kind, {})


def new_index(dim: int, factory: str):
    return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)


def apply_search_params(index, params: dict) -> None:
    space = faiss.ParameterSpace()
    for name, value in params.items():
        space.set_index_parameter(index, name, value)


class StreamingIndexer:
    """Adds embedding batches [b, D] to a FAISS index, training it first when it needs to."""

    def __init__(self, index, train_size: int):
        self.index = index
        self.train_size = train_size
        self._pending: list[np.ndarray] = []

    def add(self, emb: np.ndarray) -> None:
        if self.index.is_trained:
            self.index.add(np.ascontiguousarray(emb, np.float32))
            return
        self._pending.append(emb)
        if sum(len(e) for e in self._pending) >= self.train_size:
            self._train_and_flush()

    def finish(self):
        if self._pending:
            self._train_and_flush()
        return self.index

    def _train_and_flush(self) -> None:
        data = np.ascontiguousarray(np.concatenate(self._pending), np.float32)
        self._pending = []
        if not self.index.is_trained:
            self.index.train(data)
        self.index.add(data)


def save_index(index, folder: str | Path) -> None:
    faiss.write_index(index, str(Path(folder) / INDEX_FILE))


def load_index(path: str | Path, search_params: dict | None = None):
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no FAISS index at {path}; build one with `car-jax build-index`")
    index = faiss.read_index(str(path))
    apply_search_params(index, search_params or {})
    return index


class DenseRetriever(Retriever):
    """Encoder + FAISS index + doc store (rows of the store = ids of the index)."""

    def __init__(self, encoder, index, store: Sequence[Doc]):
        if index.d != encoder.dim:
            raise ValueError(
                f"index dimension {index.d} != encoder dimension {encoder.dim} "
                f"({encoder.spec.name}): use the encoder the index was built with"
            )
        if index.ntotal != len(store):
            raise ValueError(f"index holds {index.ntotal} vectors but the doc store {len(store)} docs")
        self.encoder, self.index, self.store = encoder, index, store

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        emb = self.encoder.encode_queries(queries)  # [B, D]
        scores, rows = self.index.search(emb, min(topk, len(self.store)))  # [B, k] each
        return [
            [dataclasses.replace(self.store[int(r)], score=float(s)) for r, s in zip(rr, ss) if r >= 0]
            for rr, ss in zip(rows, scores)
        ]

    def close(self) -> None:
        if hasattr(self.store, "close"):
            self.store.close()
