"""Retrieval server: Search-R1 JSON in and out, request validation (hostile bodies and
methods included), fair batching, the HTTP client, a bounded loopback load test, and a
client facing a stopped server."""
import concurrent.futures
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from car_jax.tools.corpus import Doc
from car_jax.tools.http_client import HttpRetriever, _parse_item, normalize_url
from car_jax.tools.index import build_bm25_index, load_retriever
from car_jax.tools.retriever import SEARCH_FAILED_PREFIX, Retriever, SearchError
from car_jax.tools.server import BatchingRetriever, RetrievalServer, ServerLimits

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
    limits = ServerLimits(max_body_bytes=64 << 10, max_queries=100, body_timeout_s=0.5)
    with RetrievalServer(backend, port=0, limits=limits, info={"backend": "bm25", "num_docs": 50}) as srv:
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
    (b"[" * (60 << 10), 400, "nested too deeply"),  # the parser's recursion limit
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


def _raw_reply(server, request: bytes, half_close: bool = False) -> tuple[bytes, dict, bytes]:
    """Send raw bytes, read the answer until the server closes: (status line, headers, body)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, dict(line.decode("latin-1").split(": ", 1) for line in lines), body


def _raw_exchange(server, request: bytes, half_close: bool) -> tuple[bytes, dict]:
    """Send raw bytes, read the answer until the server closes: (status line, JSON body)."""
    status, _, body = _raw_reply(server, request, half_close)
    return status, json.loads(body)


@pytest.mark.parametrize("half_close", [False, True])
def test_body_shorter_than_its_length_gets_400(server, half_close):
    # stalled: answered once body_timeout_s (0.5 s here) has passed, not the 30 s idle timeout
    request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"queries": []'
    status, reply = _raw_exchange(server, request, half_close)
    assert status == b"HTTP/1.1 400 Bad Request"
    assert "ended after 14 of its 100 bytes" in reply["error"]
    assert _post(server, {"queries": ["hamlet"], "topk": 1})[0] == 200  # still serving


def test_wrong_method_is_405_with_allow(server):
    host, port = server.url.removeprefix("http://").split(":")
    for method, path, allow in [("GET", "/retrieve", "POST"), ("POST", "/health", "GET"),
                                ("PUT", "/retrieve", "POST"), ("DELETE", "/health", "GET")]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, path, body=b"{}" if method != "GET" else None)
            reply = conn.getresponse()
            assert (reply.status, reply.getheader("Allow")) == (405, allow), (method, path)
            assert f"{path} takes {allow}" in json.loads(reply.read())["error"]
        finally:
            conn.close()
    assert _request(server, "PUT", "/nope", b"{}")[0] == 404


def _json_error(server, request: bytes, status: int, head_only: bool = False) -> tuple[dict, str]:
    """The answer to raw `request`: `status` as JSON on a closed connection -> (headers, error)."""
    line, headers, body = _raw_reply(server, request)
    assert line.startswith(b"HTTP/1.1 %d " % status), line
    assert headers["Content-Type"] == "application/json" and headers["Connection"] == "close"
    if head_only:  # the answer to HEAD has the headers of the JSON answer, not its body
        assert body == b"" and int(headers["Content-Length"]) > 0
        return headers, ""
    assert int(headers["Content-Length"]) == len(body)
    return headers, json.loads(body)["error"]


@pytest.mark.parametrize("value", [
    b"\xb2", b"12\xb3", b"\xb9\xb2",  # Latin-1 superscripts: str.isdigit() takes them, int() does not
    b"\xc2\xb2", b"abc", b"-1", b"+5", b"1e3", b"0x10", b"", b"9" * 5000,  # over int()'s 4,300 digits
])
def test_content_length_must_be_ascii_digits(server, value):
    request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n{}"
    _, error = _json_error(server, request, 400)
    assert "Content-Length must be a number of bytes in ASCII digits" in error
    assert _post(server, {"queries": ["hamlet"], "topk": 1})[0] == 200  # still serving


@pytest.mark.parametrize("method, path, status, allow", [
    ("OPTIONS", "/retrieve", 405, "POST"), ("OPTIONS", "/health", 405, "GET"),
    ("HEAD", "/retrieve", 405, "POST"), ("HEAD", "/health", 405, "GET"),
    ("OPTIONS", "*", 404, None), ("HEAD", "/nope", 404, None),
    ("TRACE", "/health", 501, None), ("BREW", "/retrieve", 501, None),  # methods no route knows
])
def test_every_method_gets_json(server, method, path, status, allow):
    request = f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    headers, error = _json_error(server, request, status, head_only=method == "HEAD")
    assert headers.get("Allow") == allow
    if status == 405 and method != "HEAD":
        assert f"{path} takes {allow}, not {method}" in error
    if status == 501:
        assert f"Unsupported method ('{method}')" in error


@pytest.mark.parametrize("request_, status, message", [
    (b"GARBAGE\r\n\r\n", 400, "Bad request syntax ('GARBAGE')"),
    (b"GET /health x HTTP/1.1\r\n\r\n", 400, "Bad request syntax"),
    (b"GET /health HTTP/x.y\r\n\r\n", 400, "Bad request version ('HTTP/x.y')"),
    (b"\x00\xff\xfe junk \x01\r\n\r\n", 400, "Bad request version"),
    (b"POST /retrieve\r\n\r\n", 400, "Bad HTTP/0.9 request type ('POST')"),
    (b"GET /health HTTP/2.0\r\n\r\n", 505, "Invalid HTTP version (2.0)"),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "Request-URI Too Long"),
    (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "Line too long"),
    (b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431, "Too many headers"),
])
def test_what_http_server_refuses_is_json(server, request_, status, message):
    """http.server answers these itself, before any do_* method: as JSON too, with a status
    line even when the request line was too garbled to name its HTTP version."""
    _, error = _json_error(server, request_, status)
    assert message in error
    assert _request(server, "GET", "/health")[0] == 200  # still serving


class GatedBackend(Retriever):
    """Costs time in proportion to its queries; records each batch; the first batch waits
    for `gate`, so a test can queue requests behind it in a known order."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.entered, self.gate = threading.Event(), threading.Event()

    def _search(self, queries, topk):
        self.batches.append(list(queries))
        if len(self.batches) == 1:
            self.entered.set()
            self.gate.wait(10)
        time.sleep(1e-4 * len(queries))
        return [[Doc(f"{q}#{i}", q, -i) for i in range(topk)] for q in queries]


def test_small_request_is_not_stuck_behind_big_ones():
    backend = GatedBackend()
    batcher = BatchingRetriever(backend, max_batch_queries=60)
    try:
        first = batcher.submit(["gate"], 1)
        assert backend.entered.wait(10)
        bigs = [[f"big{b}-{i}" for i in range(150)] for b in range(3)]
        requests = [(qs, 2) for qs in bigs] + [(["small"], 1)]
        futures = [batcher.submit(qs, k) for qs, k in requests]  # all queued behind the gate
        backend.gate.set()
        results = [f.result(timeout=10) for f in [first, *futures]]
    finally:
        batcher.close()
    batch_of = {q: n for n, batch in enumerate(backend.batches) for q in batch}
    done_at = [max(batch_of[q] for q in qs) for qs, _ in requests]  # the batch that completes each
    assert done_at[3] == 1  # the small request rode the first batch after the gate
    assert min(done_at[:3]) > 1 and all(len(b) <= 60 for b in backend.batches)
    assert sorted(q for b in backend.batches for q in b) == sorted(["gate", "small", *sum(bigs, [])])
    # each request got its own rows, in order, cut to its own topk
    for (qs, k), rows in zip([(["gate"], 1), *requests], results):
        assert [[d.id for d in row] for row in rows] == [[f"{q}#{i}" for i in range(k)] for q in qs]


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
