"""Retrieval: corpus format and rendering, dense (MiniLM + FAISS) and BM25 indexes built,
saved and loaded, retrieval quality on a small fixture corpus, bad queries."""
import json
from pathlib import Path

import numpy as np
import pytest

from car_jax.tools.corpus import Doc, DocStore, iter_corpus, open_store, render_docs
from car_jax.tools.dense import IndexOptions, StreamingIndexer, load_index, new_index
from car_jax.tools.index import (
    build_bm25_index,
    build_dense_index,
    load_retriever,
    read_meta,
)
from car_jax.tools.text_encoder import TextEncoder, resolve_encoder

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = FIXTURES / "tiny_wiki.jsonl"
QUESTIONS = [json.loads(line) for line in open(FIXTURES / "tiny_wiki_questions.jsonl")]
BAD_QUERIES = ["", "   ", "x" * 10_000, "war and peace " * 800, "日本の首都はどこですか", "عاصمة أستراليا", "🦘🦘 ?"]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexes")
    encoder = TextEncoder(resolve_encoder(), batch_size=16)
    build_dense_index(CORPUS, root / "dense", encoder, chunk_size=16, progress=False)
    build_bm25_index(CORPUS, root / "bm25", progress=False)
    return {"dense": root / "dense", "bm25": root / "bm25", "encoder": encoder}


@pytest.fixture(scope="module", params=["dense", "bm25"])
def retriever(request, indexes):
    encoder = indexes["encoder"] if request.param == "dense" else None
    r = load_retriever(indexes[request.param], encoder=encoder)
    yield r
    r.close()


def test_corpus_rows_and_rendering_follow_search_r1():
    docs = list(iter_corpus(CORPUS))
    assert len(docs) == 50 and docs[7].id == "7"
    assert docs[7].contents.startswith('"William Shakespeare"\n')
    assert docs[7].title == "William Shakespeare" and docs[7].text.startswith("William Shakespeare was")
    two = [Doc("1", '"A b"\nfirst text'), Doc("2", "No quotes\nline one\nline two")]
    assert render_docs(two) == 'Doc 1(Title: "A b") first text\nDoc 2(Title: No quotes) line one\nline two\n'
    assert render_docs(two, strip_title_quotes=True).startswith("Doc 1(Title: A b) first text\n")
    assert render_docs([]) == ""


def test_corpus_variants_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"title": "T", "text": "body"}\n\n{"id": 9, "contents": "X\\ny"}\n')
    docs = list(iter_corpus(path))
    assert [(d.id, d.contents) for d in docs] == [("0", '"T"\nbody'), ("9", "X\ny")]
    store = DocStore.from_jsonl(path)
    assert len(store) == 2 and store[1].id == "9" and store[-1].id == "9"
    with pytest.raises(IndexError):
        store[2]
    path.write_text('{"id": "0", "contents": "a"}\n{"id": "1"}\n')
    with pytest.raises(ValueError, match="corpus row 1"):
        list(iter_corpus(path))
    path.write_text('{"id": "0", "contents": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2: not valid JSON"):
        list(iter_corpus(path))


def test_index_folders_round_trip(indexes):
    dense_meta, bm25_meta = read_meta(indexes["dense"]), read_meta(indexes["bm25"])
    assert dense_meta["backend"] == "dense" and bm25_meta["backend"] == "bm25"
    assert dense_meta["num_docs"] == bm25_meta["num_docs"] == 50
    assert dense_meta["encoder"]["name"] == "all-MiniLM-L6-v2" and dense_meta["encoder"]["dim"] == 384
    assert dense_meta["faiss"] == {"factory": "Flat", "metric": "inner_product", "search_params": {}}
    store = open_store(indexes["dense"] / "docs.jsonl")
    assert [d.to_json() for d in store] == [d.to_json() for d in iter_corpus(CORPUS)]
    index = load_index(indexes["dense"])
    assert index.ntotal == 50 and index.d == 384
    # stored vectors are the encoder's passage embeddings of the corpus, in corpus order
    expected = indexes["encoder"].encode_passages([store[i].contents for i in (0, 17, 49)])
    np.testing.assert_allclose(index.reconstruct_n(0, 50)[[0, 17, 49]], expected, atol=1e-5)
    # a fresh load (encoder named by meta.json) answers like the shared one
    fresh = load_retriever(indexes["dense"])
    shared = load_retriever(indexes["dense"], encoder=indexes["encoder"])
    a, b = fresh.search(["capital of japan"], 3)[0], shared.search(["capital of japan"], 3)[0]
    assert [d.id for d in a] == [d.id for d in b] and a[0].id == "14"


def test_paraphrased_questions_find_their_doc(retriever):
    results = retriever.search([q["question"] for q in QUESTIONS], topk=3)
    assert len(results) == len(QUESTIONS)
    hits = [q["doc_id"] in [d.id for d in docs] for q, docs in zip(QUESTIONS, results)]
    misses = [q["question"] for q, hit in zip(QUESTIONS, hits) if not hit]
    assert sum(hits) / len(hits) >= 0.9, misses
    for docs in results:
        assert len(docs) == 3
        scores = [d.score for d in docs]
        assert scores == sorted(scores, reverse=True)


def test_bad_queries_still_answer(retriever):
    results = retriever.search(BAD_QUERIES, topk=3)
    assert [len(docs) for docs in results] == [3] * len(BAD_QUERIES)
    assert all(isinstance(d.score, float) and np.isfinite(d.score) for docs in results for d in docs)
    texts = retriever.observe(BAD_QUERIES[:2], topk=2)
    assert all(t.startswith("Doc 1(Title: ") and "\nDoc 2(Title: " in t for t in texts)
    assert retriever.search([], topk=3) == []
    assert len(retriever.search(["chess"], topk=500)[0]) == 50  # topk beyond the corpus
    with pytest.raises(TypeError, match="list of strings"):
        retriever.search("chess", topk=3)
    with pytest.raises(TypeError, match="query 1 is int"):
        retriever.search(["chess", 3], topk=3)
    with pytest.raises(ValueError, match="topk"):
        retriever.search(["chess"], topk=0)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes_agree_with_flat(indexes, kind):
    flat = load_index(indexes["dense"])
    vectors = flat.reconstruct_n(0, flat.ntotal)  # [50, 384]
    options = IndexOptions(kind=kind, nlist=4, nprobe=4, train_size=20)
    indexer = StreamingIndexer(new_index(384, options.factory(50)), options.train_size)
    for start in range(0, 50, 8):  # batches, training once 20 vectors are in
        indexer.add(vectors[start : start + 8])
    approx = indexer.finish()
    assert approx.ntotal == 50
    queries = indexes["encoder"].encode_queries([q["question"] for q in QUESTIONS[:10]])
    _, want = flat.search(queries, 1)
    _, got = approx.search(queries, 1)
    assert (want == got).mean() >= 0.9
    assert options.factory(10**6) in ("IVF4,Flat", "HNSW32")


def test_dense_index_rejects_a_mismatched_encoder(indexes, tmp_path):
    from car_jax.tools.dense import DenseRetriever

    class Small:
        dim = 8
        spec = resolve_encoder()

    with pytest.raises(ValueError, match="index dimension 384 != encoder dimension 8"):
        DenseRetriever(Small(), load_index(indexes["dense"]), open_store(indexes["dense"] / "docs.jsonl"))
    with pytest.raises(FileNotFoundError, match="build-index"):
        load_retriever(tmp_path)


def test_bm25_logs_nothing_below_a_warning(tmp_path, caplog):
    """bm25s sets its own logger to DEBUG when imported; building, loading and searching a
    BM25 index must not print its "Building index from IDs" lines on every run."""
    import logging

    from car_jax.tools.bm25 import BM25Retriever, load_bm25

    caplog.set_level(logging.DEBUG)
    build_bm25_index(CORPUS, tmp_path / "bm25", progress=False)
    docs = list(iter_corpus(CORPUS))
    BM25Retriever(load_bm25(tmp_path / "bm25"), docs).search(["who painted the ceiling"], 2)
    chatter = [r for r in caplog.records if r.name.startswith("bm25s") and r.levelno < logging.WARNING]
    assert not chatter, [r.getMessage() for r in chatter]
