"""The built-in offline worlds and their indexes.

    world_paths()       -> {"corpus": Path, "train": Path, "dev": Path}
    world_index()       -> Path of a BM25 index folder over the world corpus (built once, cached)
    world_retriever()   -> a retriever over it: the default search tool of `car-jax eval`
    search_tool(spec)   -> "world", "world-large", an index folder or a retrieval server URL as a retriever

Worlds (`name=` of the functions above):
    "world"        the small one: package data written by `car_jax.data.world_gen`
    "world-large"  `car_jax.data.world_large`: generated on first use into the car_jax cache;
                   its files are corpus, train, dev, ood, arith_train, arith_dev,
                   mixed_train, mixed_dev
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from car_jax.assets import cache_dir
from car_jax.data import world_large
from car_jax.tools.index import (
    META_FILE,
    build_bm25_index,
    load_retriever,
    open_retriever,
)

WORLD_DIR = Path(__file__).resolve().parent / "world"
FILES = {"corpus": "corpus.jsonl", "train": "train.jsonl", "dev": "dev.jsonl"}
WORLDS = ("world", world_large.NAME)


def check_world(name: str) -> None:
    if name not in WORLDS:
        raise ValueError(f"unknown world {name!r}; choose one of {', '.join(WORLDS)}")


def world_paths(name: str = "world") -> dict[str, Path]:
    """File kind ("corpus", then the splits) -> path. "world": the shipped files
    (FileNotFoundError, saying how to regenerate, if absent); "world-large": its cached
    files, generated first when missing."""
    check_world(name)
    if name == world_large.NAME:
        folder = world_large.ensure_files(cache_dir())
        return {k: folder / f"{k}.jsonl" for k in world_large.FILES}
    paths = {k: WORLD_DIR / f for k, f in FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"offline world files missing: {missing}; regenerate them with "
                                "`python -m car_jax.data.world_gen` (or reinstall car_jax)")
    return paths


def world_index(root: str | Path | None = None, progress: bool = False, name: str = "world") -> Path:
    """A BM25 index folder of world `name`'s corpus under `root` (default `car_jax.assets.cache_dir()`;
    "world-large"'s files themselves always live in the cache).

    The folder name carries a hash of the corpus, so an edited corpus gets a fresh index; an
    existing complete folder is reused. Built in a temporary folder and renamed into place, so
    an interrupted build is never picked up.
    """
    corpus = world_paths(name)["corpus"]
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:12]
    out = Path(root or cache_dir()) / f"{name.replace('-', '_')}_bm25_{digest}"
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


def world_retriever(root: str | Path | None = None, name: str = "world"):
    """World `name`'s BM25 index loaded as a retriever (a batched search tool, topk 3)."""
    return load_retriever(world_index(root, name=name))


def search_tool(spec: str):
    """A retriever from a short spec: "world" / "world-large" (that offline world's BM25
    index, built once into the cache), an http(s) URL of a Search-R1 style server, or an
    index folder."""
    return world_retriever(name=spec) if spec in WORLDS else open_retriever(spec)
