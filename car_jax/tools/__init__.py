"""Agent tools: search (dense / BM25 retrieval, a Search-R1 compatible HTTP server and client,
evidence noise) and a sandboxed Python interpreter (SimpleTIR conventions).

Names are re-exported lazily so `import car_jax.tools` does not pull in jax, faiss or bm25s;
the sandbox in particular needs nothing but the standard library.

    retriever = load_retriever("idx/")                # or HttpRetriever("127.0.0.1:8000")
    retriever.search(["who wrote hamlet"], topk=3)    # -> [[Doc, Doc, Doc]]
    retriever.observe(["who wrote hamlet"], topk=3)   # -> ["Doc 1(Title: ...) ...\\n..."]

    tool = PythonTool(SandboxConfig(timeout_s=5))
    tool.observe([model_reply, ...])                  # -> ["Code execution result: 42", None, ...]

Both are batched tools for the episode loop: `retriever(queries)` and `tool(codes)` return one
observation text per request.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Doc": "car_jax.tools.corpus",
    "DocStore": "car_jax.tools.corpus",
    "iter_corpus": "car_jax.tools.corpus",
    "render_docs": "car_jax.tools.corpus",
    "Retriever": "car_jax.tools.retriever",
    "SearchError": "car_jax.tools.retriever",
    "SEARCH_FAILED_PREFIX": "car_jax.tools.retriever",
    "EncoderSpec": "car_jax.tools.text_encoder",
    "TextEncoder": "car_jax.tools.text_encoder",
    "resolve_encoder": "car_jax.tools.text_encoder",
    "DenseRetriever": "car_jax.tools.dense",
    "IndexOptions": "car_jax.tools.dense",
    "BM25Retriever": "car_jax.tools.bm25",
    "BM25Options": "car_jax.tools.bm25",
    "build_dense_index": "car_jax.tools.index",
    "build_bm25_index": "car_jax.tools.index",
    "load_retriever": "car_jax.tools.index",
    "HttpRetriever": "car_jax.tools.http_client",
    "RetrievalServer": "car_jax.tools.server",
    "ServerLimits": "car_jax.tools.server",
    "NoiseConfig": "car_jax.tools.noise",
    "NoisyRetriever": "car_jax.tools.noise",
    "SandboxConfig": "car_jax.tools.sandbox",
    "SandboxResult": "car_jax.tools.sandbox",
    "SandboxError": "car_jax.tools.sandbox",
    "run_python": "car_jax.tools.sandbox",
    "PythonTool": "car_jax.tools.python_tool",
    "extract_code": "car_jax.tools.python_tool",
    "format_observation": "car_jax.tools.python_tool",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'car_jax.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
