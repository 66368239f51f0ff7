"""The built-in offline world (package data, made by `car_jax.data.world_gen`) and its index.

    world_paths()       -> {"corpus": Path, "train": Path, "dev": Path}
    world_index()       -> Path of a BM25 index folder over the world corpus (built once, cached)
    world_retriever()   -> a retriever over it: the default search tool of `car-jax eval`
    search_tool(spec)   -> "world", an index folder or a retrieval server URL as a retriever
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from car_jax.assets import cache_dir
from car_jax.tools.index import (
    META_FILE,
    build_bm25_index,
    load_retriever,
    open_retriever,
)

WORLD_DIR = Path(__file__).resolve().parent / "world"
FILES = {"corpus": "corpus.jsonl", "train": "train.jsonl", "dev": "dev.jsonl"}


def world_paths() -> dict[str, Path]:
    """Paths of the shipped world files; FileNotFoundError (saying how to regenerate) if absent."""
    paths = {k: WORLD_DIR / name for k, name in FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"offline world files missing: {missing}; regenerate them with "
                                "`python -m car_jax.data.world_gen` (or reinstall car_jax)")
    return paths


def world_index(root: str | Path | None = None, progress: bool = False) -> Path:
    """A BM25 index folder of the world corpus under `root` (default `car_jax.assets.cache_dir()`).

    The folder name carries a hash of the corpus, so an edited corpus gets a fresh index; an
    existing complete folder is reused. Built in a temporary folder and renamed into place, so
    an interrupted build is never picked up.
    """
    corpus = world_paths()["corpus"]
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:12]
    out = Path(root or cache_dir()) / f"world_bm25_{digest}"
    if (out / META_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_bm25_index(corpus, tmp, progress=progress)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def world_retriever(root: str | Path | None = None):
    """The world BM25 index loaded as a retriever (a batched search tool, topk 3)."""
    return load_retriever(world_index(root))


def search_tool(spec: str):
    """A retriever from a short spec: "world" (the offline world's BM25 index, built once
    into the cache), an http(s) URL of a Search-R1 style server, or an index folder."""
    return world_retriever() if spec == "world" else open_retriever(spec)
