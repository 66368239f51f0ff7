"""A Search-R1 compatible retrieval server on the standard library's ThreadingHTTPServer.

    POST /retrieve  {"queries": [str, ...], "topk": 3, "return_scores": true}
        -> 200 {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}
           with "return_scores": false (Search-R1's default) each row is a list of documents.
    GET /health     -> 200 {"status": "ok", "backend": ..., "num_docs": ...}

Binds 127.0.0.1 unless told otherwise. Requests are validated: a body over `max_body_bytes`
gets 413, a missing length 411, bad JSON or fields 400 (`{"error": ...}` explains which),
unknown paths 404; backend failures 500. Connections speak HTTP/1.1 keep-alive.

Concurrent requests are coalesced by `BatchingRetriever`: one worker thread takes every
request waiting in the queue and searches them as one batch (one encoder call), so many
small requests cost about as much as one big one, and the backend is only ever called from
one thread.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever, SearchError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_queries: int = 1024  # per request
    max_topk: int = 100
    default_topk: int = 3  # when a request sends no topk (Search-R1 falls back the same way)
    socket_timeout_s: float = 30.0  # idle keep-alive / slow client


class BatchingRetriever(Retriever):
    """Serializes and coalesces `search` calls from many threads onto one backend thread."""

    def __init__(self, base: Retriever, max_batch_queries: int = 256):
        self.base, self.max_batch = base, max_batch_queries
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="retriever-batcher", daemon=True)
        self._worker.start()

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        if self._closed:
            raise SearchError("the retriever is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((queries, topk, future))
        return future.result()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, n = [item], len(item[0])
            while n < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
                n += len(nxt[0])
            self._serve(batch)

    def _serve(self, batch) -> None:
        queries = [q for qs, _, _ in batch for q in qs]
        try:
            results = self.base.search(queries, max(k for _, k, _ in batch))
        except BaseException as err:  # hand the failure to every waiting caller
            for _, _, future in batch:
                future.set_exception(err)
            return
        start = 0
        for qs, k, future in batch:
            future.set_result([docs[:k] for docs in results[start : start + len(qs)]])
            start += len(qs)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=10)


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Search-R1 request body -> (queries, topk, return_scores); _BadRequest when invalid."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}") from None
    if not isinstance(req, dict):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "body must be a JSON object with a 'queries' list")
    queries = req.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise _BadRequest(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{len(queries)} queries in one request; the limit is {limits.max_queries}",
        )
    topk = req.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise _BadRequest(
            HTTPStatus.BAD_REQUEST, f"'topk' must be an int in [1, {limits.max_topk}], got {topk!r}"
        )
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "'return_scores' must be true or false")
    return queries, topk, return_scores


def format_reply(results: list[list[Doc]], return_scores: bool) -> dict:
    """Search-R1 reply: rows of {"document", "score"} or, without scores, rows of documents."""
    if return_scores:
        return {"result": [[{"document": d.to_json(), "score": d.score} for d in docs] for docs in results]}
    return {"result": [[d.to_json() for d in docs] for docs in results]}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def setup(self):
        self.timeout = self.server.limits.socket_timeout_s
        super().setup()

    def log_message(self, fmt, *args):  # per-request lines go to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: HTTPStatus, obj: dict) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _discard(self, length: int) -> None:
        """Drain (at most 16 x the limit of) an oversized body, then close the connection."""
        self.close_connection = True
        left = min(length, 16 * self.server.limits.max_body_bytes)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)

    def do_GET(self):
        if self.path.split("?")[0] != "/health":
            return self._send(HTTPStatus.NOT_FOUND, {"error": f"no route GET {self.path}; try /health"})
        self._send(HTTPStatus.OK, {"status": "ok", **self.server.info})

    def do_POST(self):
        limits = self.server.limits
        try:
            if self.path.split("?")[0] != "/retrieve":
                raise _BadRequest(HTTPStatus.NOT_FOUND, f"no route POST {self.path}; use /retrieve")
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self.close_connection = True
                raise _BadRequest(HTTPStatus.LENGTH_REQUIRED, "a numeric Content-Length header is required")
            length = int(length)
            if length > limits.max_body_bytes:
                self._discard(length)  # so the client can read the 413 instead of a reset
                raise _BadRequest(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"body of {length} bytes exceeds the limit of {limits.max_body_bytes}",
                )
            queries, topk, return_scores = parse_request(self.rfile.read(length), limits)
        except _BadRequest as err:
            return self._send(err.status, {"error": str(err)})
        try:
            results = self.server.retriever.search(queries, topk)
        except Exception as err:  # noqa: BLE001 - report, keep serving
            log.exception("search failed")
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"search failed: {err}"})
        self._send(HTTPStatus.OK, format_reply(results, return_scores))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # listen backlog: many clients connect at once

    def __init__(self, address, retriever: Retriever, limits: ServerLimits, info: dict):
        super().__init__(address, _Handler)
        self.retriever, self.limits, self.info = retriever, limits, info


class RetrievalServer:
    """Serve a retriever over HTTP. `start()` runs it on a background thread (tests, notebooks);
    `serve_forever()` blocks (the CLI)."""

    def __init__(
        self,
        retriever: Retriever,
        host: str = "127.0.0.1",
        port: int = 8000,
        limits: ServerLimits = ServerLimits(),
        info: dict | None = None,
    ):
        self.batcher = BatchingRetriever(retriever)
        self._httpd = _Server((host, port), self.batcher, limits, info or {})
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "RetrievalServer":
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="retrieval-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self._httpd.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        """Stop accepting, close the socket, stop the batcher (the backend stays open)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()
        self.batcher.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
