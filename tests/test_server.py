"""Retrieval server: Search-R1 JSON in and out, request validation, the HTTP client,
a bounded loopback load test, and a client facing a stopped server."""
import concurrent.futures
import http.client
import json
import socket
import time
from pathlib import Path

import pytest

from car_jax.tools.corpus import Doc
from car_jax.tools.http_client import HttpRetriever, _parse_item, normalize_url
from car_jax.tools.index import build_bm25_index, load_retriever
from car_jax.tools.retriever import SEARCH_FAILED_PREFIX, SearchError
from car_jax.tools.server import RetrievalServer, ServerLimits

CORPUS = Path(__file__).parent / "fixtures" / "tiny_wiki.jsonl"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bm25")
    build_bm25_index(CORPUS, folder, progress=False)
    retriever = load_retriever(folder)
    yield retriever
    retriever.close()


@pytest.fixture(scope="module")
def server(backend):
    with RetrievalServer(backend, port=0, limits=ServerLimits(max_body_bytes=64 << 10, max_queries=100),
                         info={"backend": "bm25", "num_docs": 50}) as srv:
        yield srv


def _request(server, method, path, body=None, headers=None):
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def _post(server, payload):
    return _request(server, "POST", "/retrieve", json.dumps(payload).encode(), {"Content-Type": "application/json"})


def test_binds_loopback_and_reports_health(server):
    assert server.url.startswith("http://127.0.0.1:")
    assert _request(server, "GET", "/health") == (200, {"status": "ok", "backend": "bm25", "num_docs": 50})


def test_search_r1_reply_with_scores(server, backend):
    status, reply = _post(server, {"queries": ["who wrote hamlet", "capital of japan"], "topk": 2,
                                   "return_scores": True})
    assert status == 200 and list(reply) == ["result"] and len(reply["result"]) == 2
    for row, query in zip(reply["result"], ["who wrote hamlet", "capital of japan"]):
        assert len(row) == 2
        for item in row:
            assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
        expected = backend.search([query], 2)[0]
        assert [i["document"]["id"] for i in row] == [d.id for d in expected]
        assert [i["score"] for i in row] == pytest.approx([d.score for d in expected])
    assert reply["result"][0][0]["document"]["contents"].startswith('"William Shakespeare"\n')


def test_search_r1_reply_without_scores_and_default_topk(server):
    status, reply = _post(server, {"queries": ["who wrote hamlet"]})  # Search-R1 defaults
    assert status == 200 and len(reply["result"][0]) == 3
    assert all(set(doc) == {"id", "contents"} for doc in reply["result"][0])
    assert _post(server, {"queries": [], "topk": 3}) == (200, {"result": []})


@pytest.mark.parametrize("body, status, message", [
    (b"not json", 400, "not valid JSON"),
    (b'["a"]', 400, "JSON object"),
    (b'{"queries": "one string"}', 400, "list of strings"),
    (b'{"queries": ["a", 5]}', 400, "list of strings"),
    (b'{"queries": ["a"], "topk": 0}', 400, "topk"),
    (b'{"queries": ["a"], "topk": true}', 400, "topk"),
    (b'{"queries": ["a"], "topk": 101}', 400, "topk"),
    (b'{"queries": ["a"], "return_scores": "yes"}', 400, "return_scores"),
    (json.dumps({"queries": ["a"] * 101}).encode(), 413, "101 queries"),
    (json.dumps({"queries": ["a" * (70 << 10)]}).encode(), 413, "exceeds the limit"),
])
def test_malformed_requests_get_4xx(server, body, status, message):
    got_status, reply = _request(server, "POST", "/retrieve", body)
    assert got_status == status and message in reply["error"]


def test_routes_and_missing_length(server):
    assert _request(server, "GET", "/nope")[0] == 404
    assert _request(server, "POST", "/search", b"{}")[0] == 404
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 411")


def test_bad_queries_through_the_server(server):
    queries = ["", "x" * 10_000, "東京はどこ", "Столица Австралии", "🦘"]
    client = HttpRetriever(server.url)
    assert [len(docs) for docs in client.search(queries, topk=3)] == [3] * 5


def test_client_matches_in_process_retriever(server, backend):
    client = HttpRetriever(server.url.removeprefix("http://"))  # host:port form
    queries = ["largest planet", "who discovered penicillin", "speed of light in vacuum"]
    remote, local = client.search(queries, 3), backend.search(queries, 3)
    assert [[d.id for d in r] for r in remote] == [[d.id for d in r] for r in local]
    assert client.observe(queries, 3) == backend.observe(queries, 3)
    assert client(queries) == backend(queries) == backend.observe(queries, 3)  # the tool form
    assert normalize_url("http://h:1/") == "http://h:1/retrieve" == normalize_url("h:1/retrieve")


def test_client_reads_both_search_r1_reply_forms():
    scored = _parse_item({"document": {"id": 3, "contents": '"T"\nx'}, "score": 0.5}, 0)
    bare = _parse_item({"id": "3", "contents": '"T"\nx'}, 0)
    assert scored == Doc("3", '"T"\nx', 0.5) and bare == Doc("3", '"T"\nx', None)


def test_observation_matches_search_r1_formatting(server):
    # Search-R1's client renders reply["result"][i] doc by doc: title = first line, text = rest
    _, reply = _post(server, {"queries": ["eiffel tower paris"], "topk": 3, "return_scores": True})
    lines = []
    for i, item in enumerate(reply["result"][0]):
        first, _, rest = item["document"]["contents"].partition("\n")
        lines.append(f"Doc {i + 1}(Title: {first}) {rest}\n")
    assert HttpRetriever(server.url).observe(["eiffel tower paris"], 3) == ["".join(lines)]


def test_load_64_clients_x_50_requests(server):
    client = HttpRetriever(server.url, timeout_s=60, retries=0)
    queries = ["capital of australia", "who painted the starry night", "largest hot desert", ""]

    def worker(w):
        errors, latencies = 0, []
        for i in range(50):
            start = time.perf_counter()
            try:
                rows = client.search([queries[(w + i) % 4]], topk=3)
                errors += len(rows) != 1 or len(rows[0]) != 3
            except SearchError:
                errors += 1
            latencies.append(time.perf_counter() - start)
        return errors, latencies

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(worker, range(64)))
    assert sum(e for e, _ in outcomes) == 0
    assert sum(len(lat) for _, lat in outcomes) == 64 * 50


def test_stopped_server_gives_search_failed_text(backend):
    srv = RetrievalServer(backend, port=0).start()
    url = srv.url
    srv.close()
    client = HttpRetriever(url, timeout_s=2, retries=1, backoff_s=0.01)
    obs = client.observe(["who wrote hamlet", "x"], topk=3)
    assert len(obs) == 2 and all(o.startswith(SEARCH_FAILED_PREFIX) and "cannot reach" in o for o in obs)
    with pytest.raises(SearchError, match="cannot reach"):
        client.search(["q"], 3)


def test_server_errors_are_500_and_not_retried_4xx(backend):
    class Broken(type(backend)):
        def __init__(self):
            pass

        def _search(self, queries, topk):
            raise RuntimeError("index exploded")

    with RetrievalServer(Broken(), port=0) as srv:
        status, reply = _post(srv, {"queries": ["a"]})
        assert status == 500 and "index exploded" in reply["error"]
        obs = HttpRetriever(srv.url, retries=1, backoff_s=0.01).observe(["a"], 3)
        assert obs[0].startswith(SEARCH_FAILED_PREFIX + "HTTP 500")
        obs = HttpRetriever(srv.url, retries=5, backoff_s=5).observe(["a"], 1000)  # 400: no retry
        assert "HTTP 400" in obs[0]
