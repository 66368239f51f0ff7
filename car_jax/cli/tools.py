"""`car-jax build-index` and `car-jax serve-retriever`.

    car-jax build-index --corpus wiki.jsonl --out idx/ [--backend dense|bm25] [--encoder PATH]
    car-jax serve-retriever --index idx/ [--host 127.0.0.1] [--port 8000]
    car-jax serve-retriever --faiss-index e5_Flat.index --corpus wiki-18.jsonl --encoder e5-base-v2/
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("build-index", help="build a dense (FAISS) or BM25 index over a JSONL corpus")
    p.add_argument("--corpus", required=True, help='JSONL, one {"id", "contents"} per line')
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--backend", choices=("dense", "bm25"), default="dense")
    _encoder_args(p)
    p.add_argument("--index-type", choices=("flat", "ivf", "hnsw"), default="flat")
    p.add_argument("--nlist", type=int, default=1024, help="ivf: inverted lists")
    p.add_argument("--nprobe", type=int, default=32, help="ivf: lists searched per query")
    p.add_argument("--hnsw-m", type=int, default=32, help="hnsw: links per node")
    p.add_argument("--ef-search", type=int, default=128, help="hnsw: search breadth")
    p.add_argument("--batch-size", type=int, default=64, help="encoder batch")
    p.add_argument("--chunk-size", type=int, default=1024, help="docs encoded between index adds")
    p.set_defaults(func=build_index_command)

    s = subparsers.add_parser("serve-retriever", help="serve an index with the Search-R1 /retrieve API")
    s.add_argument("--index", help="folder written by build-index")
    s.add_argument("--faiss-index", help="a Search-R1 style FAISS file (with --corpus and --encoder)")
    s.add_argument("--corpus", help="JSONL corpus whose rows match --faiss-index")
    _encoder_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--topk", type=int, default=3, help="topk when a request gives none")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--noise-drop", type=float, default=0.0, help="evidence noise: drop rate")
    s.add_argument("--noise-shuffle", type=float, default=0.0, help="evidence noise: shuffle rate")
    s.add_argument("--noise-replace", type=float, default=0.0, help="evidence noise: distractor rate")
    s.add_argument("--noise-seed", type=int, default=0)
    s.set_defaults(func=serve_retriever_command)


def _encoder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoder", default=None,
                   help="'minilm' (offline default) or an HF folder (e5-base-v2 gets 'query: '/'passage: ')")
    p.add_argument("--query-prefix", default=None)
    p.add_argument("--passage-prefix", default=None)
    p.add_argument("--max-length", type=int, default=None, help="encoder tokens per text")


def _make_encoder(args, batch_size: int = 64):
    from car_jax.tools.text_encoder import TextEncoder, resolve_encoder

    spec = resolve_encoder(args.encoder, args.query_prefix, args.passage_prefix, args.max_length)
    return TextEncoder(spec, batch_size=batch_size)


def build_index_command(args) -> int:
    from car_jax.tools.bm25 import BM25Options
    from car_jax.tools.dense import IndexOptions
    from car_jax.tools.index import build_bm25_index, build_dense_index

    if args.backend == "bm25":
        meta = build_bm25_index(args.corpus, args.out, BM25Options())
    else:
        options = IndexOptions(kind=args.index_type, nlist=args.nlist, nprobe=args.nprobe,
                               hnsw_m=args.hnsw_m, ef_search=args.ef_search)
        meta = build_dense_index(args.corpus, args.out, _make_encoder(args, args.batch_size),
                                 options, chunk_size=args.chunk_size)
    print(f"built {meta['backend']} index of {meta['num_docs']} docs in {args.out}")
    return 0


def _load(args):
    from car_jax.tools.index import load_retriever, read_meta

    if args.index:
        meta = read_meta(args.index)
        encoder = _make_encoder(args) if args.encoder and meta["backend"] == "dense" else None
        info = {"backend": meta["backend"], "num_docs": meta["num_docs"]}
        return load_retriever(args.index, encoder=encoder), info
    if not (args.faiss_index and args.corpus and args.encoder):
        raise SystemExit(
            "serve-retriever needs --index DIR, or --faiss-index, --corpus and --encoder together"
        )
    from car_jax.tools.corpus import DocStore
    from car_jax.tools.dense import DenseRetriever, load_index

    store = DocStore.from_jsonl(args.corpus)
    return DenseRetriever(_make_encoder(args), load_index(args.faiss_index), store), {
        "backend": "dense", "num_docs": len(store)}


# libraries whose INFO records are start-up noise at serve-retriever's INFO level: faiss's
# loader ("Loading faiss with AVX2 support", "Could not load library with AVX2 support ...")
# and jax's backend probe ("Unable to initialize backend 'tpu': ... libtpu.so ..."); kept at
# WARNING, as car_jax.tools.bm25 keeps bm25s
QUIET_LOGGERS = ("faiss", "jax._src.xla_bridge")


def setup_logging() -> None:
    """serve-retriever's logging: INFO lines with time and logger name, QUIET_LOGGERS at WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def serve_retriever_command(args) -> int:
    from car_jax.tools.noise import NoiseConfig, NoisyRetriever
    from car_jax.tools.server import RetrievalServer, ServerLimits

    setup_logging()
    retriever, info = _load(args)
    if hasattr(retriever, "encoder"):
        retriever.encoder.warmup()  # compile query shapes before the first request
    noise = NoiseConfig(args.noise_drop, args.noise_shuffle, args.noise_replace, args.noise_seed)
    if noise.active:
        retriever = NoisyRetriever(retriever, noise, retriever.store)
        info["noise"] = dataclasses.asdict(noise)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, default_topk=args.topk)
    server = RetrievalServer(retriever, args.host, args.port, limits, info)
    print(f"serving {info['backend']} retriever over {info['num_docs']} docs at {server.url}/retrieve",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        retriever.close()
    return 0
