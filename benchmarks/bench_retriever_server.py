"""Load test of the Search-R1 compatible retrieval server on loopback.

C concurrent clients (threads, each with car_jax's HttpRetriever: urllib, one connection per
request) send R single-query requests each (topk 3, return_scores true) to a server over the
fixture corpus; we record per-request latency and errors. Rows: dense (MiniLM in JAX + FAISS
flat) and BM25 (bm25s), each with request coalescing (the default: one backend call for all
requests waiting) and without it (one backend call per request, the way a plain
one-request-per-call server works).

    .venv/bin/python benchmarks/bench_retriever_server.py --clients 64 --requests 50
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from car_jax.tools.http_client import HttpRetriever  # noqa: E402
from car_jax.tools.index import build_bm25_index, build_dense_index, load_retriever  # noqa: E402
from car_jax.tools.retriever import SearchError  # noqa: E402
from car_jax.tools.server import RetrievalServer  # noqa: E402
from car_jax.tools.text_encoder import TextEncoder, resolve_encoder  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def load(url: str, queries: list[str], clients: int, requests: int) -> dict:
    client = HttpRetriever(url, timeout_s=120, retries=0)

    def worker(w: int):
        errors, lat = 0, []
        for i in range(requests):
            start = time.perf_counter()
            try:
                rows = client.search([queries[(w * requests + i) % len(queries)]], topk=3)
                errors += len(rows[0]) != 3
            except SearchError:
                errors += 1
            lat.append(time.perf_counter() - start)
        return errors, lat

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        outcomes = list(pool.map(worker, range(clients)))
    wall = time.perf_counter() - start
    lat = sorted(x for _, ls in outcomes for x in ls)
    return {
        "requests": len(lat),
        "errors": sum(e for e, _ in outcomes),
        "p50_ms": 1e3 * lat[len(lat) // 2],
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "mean_ms": 1e3 * statistics.fmean(lat),
        "req_per_s": len(lat) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    parser.add_argument("--corpus", default=str(FIXTURES / "tiny_wiki.jsonl"))
    parser.add_argument("--questions", default=str(FIXTURES / "tiny_wiki_questions.jsonl"))
    args = parser.parse_args()
    queries = [json.loads(line)["question"] for line in open(args.questions)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        encoder = TextEncoder(resolve_encoder())
        build_dense_index(args.corpus, Path(tmp, "dense"), encoder, progress=False)
        build_bm25_index(args.corpus, Path(tmp, "bm25"), progress=False)
        encoder.warmup()  # compile the query shapes before timing
        for backend in ("dense", "bm25"):
            retriever = load_retriever(Path(tmp, backend), encoder=encoder if backend == "dense" else None)
            for coalesce in (True, False):
                server = RetrievalServer(retriever, port=0).start()
                server.batcher.max_batch = server.batcher.max_batch if coalesce else 1
                stats = load(server.url, queries, args.clients, args.requests)
                server.close()
                rows.append({"backend": backend, "coalescing": "yes" if coalesce else "no", **stats})
    print("| backend | coalescing | requests | errors | p50 ms | p99 ms | mean ms | req/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['coalescing']} | {r['requests']} | {r['errors']} | {r['p50_ms']:.1f} "
              f"| {r['p99_ms']:.1f} | {r['mean_ms']:.1f} | {r['req_per_s']:.0f} |")


if __name__ == "__main__":
    main()
