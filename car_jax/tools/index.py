"""Build, save and load retrieval indexes (one folder each).

    <index_dir>/meta.json             backend, doc count, encoder spec (dense), options
    <index_dir>/docs.jsonl            {"id", "contents"} per line, row i = index id i
    <index_dir>/docs.jsonl.offsets.npy
    <index_dir>/index.faiss           dense backend
    <index_dir>/bm25/                 bm25 backend (bm25s files)

`load_retriever(index_dir)` rebuilds the retriever the folder describes; a dense index loads
the encoder its meta names (override with `encoder=` when the folder moved).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

from tqdm import tqdm

from car_jax.tools.bm25 import (
    BM25Options,
    BM25Retriever,
    build_bm25,
    load_bm25,
    save_bm25,
)
from car_jax.tools.corpus import DocStoreWriter, count_lines, iter_corpus, open_store
from car_jax.tools.dense import (
    DenseRetriever,
    IndexOptions,
    StreamingIndexer,
    load_index,
    new_index,
    save_index,
)
from car_jax.tools.http_client import HttpRetriever
from car_jax.tools.retriever import Retriever
from car_jax.tools.text_encoder import (
    MINILM_NAMES,
    EncoderSpec,
    TextEncoder,
    minilm_path,
)

META_FILE = "meta.json"
DOCS_FILE = "docs.jsonl"
FORMAT_VERSION = 1


def _write_meta(folder: Path, meta: dict) -> dict:
    meta = {"format_version": FORMAT_VERSION, **meta,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {META_FILE}: not an index built by `car-jax build-index`")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return meta


def build_dense_index(
    corpus: str | Path,
    out_dir: str | Path,
    encoder: TextEncoder,
    options: IndexOptions = IndexOptions(),
    chunk_size: int = 1024,
    progress: bool = True,
) -> dict:
    """Encode every doc of a JSONL corpus (passage prefix + contents) into a FAISS index,
    `chunk_size` docs at a time; writes the folder described above, returns the meta dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = count_lines(corpus)
    factory = options.factory(total)
    indexer = StreamingIndexer(new_index(encoder.dim, factory), options.train_size)
    writer = DocStoreWriter(out / DOCS_FILE)
    chunk: list[str] = []
    with tqdm(total=total, desc="encoding corpus", unit="doc", disable=not progress) as bar:
        for doc in iter_corpus(corpus):
            writer.add(doc)
            chunk.append(doc.contents)
            if len(chunk) == chunk_size:
                indexer.add(encoder.encode_passages(chunk))
                bar.update(len(chunk))
                chunk = []
        if chunk:
            indexer.add(encoder.encode_passages(chunk))
            bar.update(len(chunk))
    offsets = writer.close()
    if len(offsets) == 1:
        raise ValueError(f"corpus {corpus} has no documents")
    save_index(indexer.finish(), out)
    return _write_meta(out, {
        "backend": "dense",
        "num_docs": len(offsets) - 1,
        "corpus": str(Path(corpus).resolve()),
        "encoder": {**encoder.spec.to_json(), "dim": encoder.dim},
        "faiss": {"factory": factory, "metric": "inner_product", "search_params": options.search_params()},
    })


def build_bm25_index(
    corpus: str | Path, out_dir: str | Path, options: BM25Options = BM25Options(), progress: bool = True
) -> dict:
    """Fit bm25s on a JSONL corpus (all texts in memory, as bm25s requires); returns meta."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = DocStoreWriter(out / DOCS_FILE)
    texts = []
    for doc in iter_corpus(corpus):
        writer.add(doc)
        texts.append(doc.contents)
    writer.close()
    if not texts:
        raise ValueError(f"corpus {corpus} has no documents")
    save_bm25(build_bm25(texts, options, progress=progress), out)
    return _write_meta(out, {
        "backend": "bm25",
        "num_docs": len(texts),
        "corpus": str(Path(corpus).resolve()),
        "bm25": dataclasses.asdict(options),
    })


def load_retriever(
    index_dir: str | Path, encoder: TextEncoder | None = None, search_params: dict | None = None
) -> Retriever:
    """An index folder -> DenseRetriever or BM25Retriever, ready to search."""
    folder = Path(index_dir)
    meta = read_meta(folder)
    store = open_store(folder / DOCS_FILE)
    if len(store) != meta["num_docs"]:
        raise ValueError(f"{folder}: {DOCS_FILE} has {len(store)} docs, meta.json says {meta['num_docs']}")
    if meta["backend"] == "bm25":
        return BM25Retriever(load_bm25(folder), store, BM25Options(**meta.get("bm25", {})))
    if meta["backend"] != "dense":
        raise ValueError(f"{folder}: unknown backend {meta['backend']!r}")
    params = {**meta["faiss"].get("search_params", {}), **(search_params or {})}
    if encoder is None:
        spec = EncoderSpec.from_json(meta["encoder"])
        if not Path(spec.path).is_dir() and spec.name.lower() in MINILM_NAMES:
            spec = dataclasses.replace(spec, path=str(minilm_path()))  # the venv moved
        if not Path(spec.path).is_dir():
            raise FileNotFoundError(
                f"{folder} was built with encoder {spec.name!r} at {spec.path}, which is gone; "
                "pass the encoder folder explicitly (--encoder)"
            )
        encoder = TextEncoder(spec)
    return DenseRetriever(encoder, load_index(folder, params), store)


def open_retriever(spec: str):
    """A retriever from a short spec: an http(s) URL of a Search-R1 style server, or an
    index folder. (The offline world's "world" spec is `car_jax.data.search_tool`'s: tools
    never import data.)"""
    if spec.startswith(("http://", "https://")):
        return HttpRetriever(spec)
    return load_retriever(spec)
