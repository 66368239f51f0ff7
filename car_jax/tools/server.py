"""A Search-R1 compatible retrieval server on the standard library's ThreadingHTTPServer.

    POST /retrieve  {"queries": [str, ...], "topk": 3, "return_scores": true}
        -> 200 {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}
           with "return_scores": false (Search-R1's default) each row is a list of documents.
    GET /health     -> 200 {"status": "ok", "backend": ..., "num_docs": ...}

Binds 127.0.0.1 unless told otherwise. Every request gets a JSON answer: a body over
`max_body_bytes` gets 413, a missing length 411, a Content-Length that is not ASCII digits 400,
bad JSON or fields 400 (`{"error": ...}` explains which; JSON nested too deeply for the parser
included), a body that stops short of its Content-Length 400 once `body_timeout_s` has passed
(separate from the idle keep-alive `socket_timeout_s`), a known path with the wrong method
(HEAD and OPTIONS included) 405 with an `Allow` header, unknown paths 404, unknown methods 501;
backend failures 500. What http.server refuses by itself (a garbled request line 400, a request
line over 64 KB 414, a header line over 64 KB or over 100 headers 431) is JSON too
(`_Handler.send_error`). Connections speak HTTP/1.1 keep-alive; an error answered before the
body was read closes the connection (the unread body would be taken for the next request).

Concurrent requests are coalesced by `BatchingRetriever` (car_jax.tools.batching): one
worker thread searches fair batches made of slices of every waiting request, so many small
requests cost about as much as one big one, a small request is not stuck behind big ones,
and the backend is only ever called from one thread.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from car_jax.tools.batching import BatchingRetriever
from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever

log = logging.getLogger(__name__)
ROUTES = {"/retrieve": "POST", "/health": "GET"}  # path -> its one method
# ASCII digits only (str.isdigit also takes "²", which int() refuses); 18 of them is an exabyte
_LENGTH_RE = re.compile(r"[0-9]{1,18}")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_queries: int = 1024  # per request
    max_topk: int = 100
    default_topk: int = 3  # when a request sends no topk (Search-R1 falls back the same way)
    socket_timeout_s: float = 30.0  # idle keep-alive / slow client between requests
    body_timeout_s: float = 10.0  # the whole body must arrive within this, once the headers have
    max_batch_queries: int = 256  # per backend call (see BatchingRetriever)


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Search-R1 request body -> (queries, topk, return_scores); _BadRequest when invalid."""
    try:
        req = json.loads(body)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise _BadRequest(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}") from None
    except RecursionError:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "body is not valid JSON: nested too deeply") from None
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

    def _send(self, status: HTTPStatus, obj: dict, headers: dict | None = None) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # its answer has headers only (RFC 9110, 9.3.2)
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        """What http.server refuses before a do_* method runs (a garbled request line, a header
        line over 64 KB, too many headers, an unknown method) is answered as JSON like the rest,
        not as its HTML page; the connection closes."""
        self.log_error("code %d, message %s", code, message)
        if self.request_version == "HTTP/0.9":  # a line too garbled to name its version
            self.request_version = self.protocol_version  # still gets a status line and headers
        self.close_connection = True
        status = HTTPStatus(code)
        self._send(status, {"error": ": ".join(filter(None, [message or status.phrase, explain]))})

    def _receive(self, length: int, keep: bool = True) -> tuple[bytes, int]:
        """Read up to `length` body bytes, stopping when the client closes its side or
        `body_timeout_s` has passed; returns (the bytes if `keep`, how many arrived)."""
        limits = self.server.limits
        deadline = time.monotonic() + limits.body_timeout_s
        chunks, got = [], 0
        try:
            while got < length and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    break
                got += len(chunk)
                if keep:
                    chunks.append(chunk)
        except OSError:  # TimeoutError included: the client stalled or went away
            pass
        finally:
            self.connection.settimeout(limits.socket_timeout_s)
        return b"".join(chunks), got

    def _discard(self, length: int) -> None:
        """Drain (at most 16 x the limit of) an oversized body, then close the connection."""
        self.close_connection = True
        self._receive(min(length, 16 * self.server.limits.max_body_bytes), keep=False)

    def _read_body(self, length: int) -> bytes:
        """Exactly `length` bytes, all within `body_timeout_s`; else _BadRequest (400)."""
        body, got = self._receive(length)
        if got < length:
            self.close_connection = True
            raise _BadRequest(
                HTTPStatus.BAD_REQUEST,
                f"the body ended after {got} of its {length} bytes (Content-Length) "
                f"within {self.server.limits.body_timeout_s:g} s",
            )
        return body

    def _route(self, method: str) -> None:
        """_BadRequest unless `method` is the one for this path (404 / 405 with Allow)."""
        path = self.path.split("?")[0]
        if path not in ROUTES:
            routes = ", ".join(f"{m} {p}" for p, m in ROUTES.items())
            raise _BadRequest(HTTPStatus.NOT_FOUND, f"no route {method} {self.path}; use {routes}")
        if ROUTES[path] != method:
            raise _BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {ROUTES[path]}, not {method}")

    def _refuse(self, err: _BadRequest) -> None:
        headers = {"Allow": ROUTES[self.path.split("?")[0]]} if err.status == HTTPStatus.METHOD_NOT_ALLOWED else {}
        self._send(err.status, {"error": str(err)}, headers)

    def do_GET(self):
        try:
            self._route("GET")
        except _BadRequest as err:
            return self._refuse(err)
        self._send(HTTPStatus.OK, {"status": "ok", **self.server.info})

    def _not_allowed(self):
        """Any other method: the body (if any) stays unread, so the connection closes."""
        self.close_connection = True
        try:
            self._route(self.command)
        except _BadRequest as err:
            return self._refuse(err)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    def do_POST(self):
        limits = self.server.limits
        try:
            try:
                self._route("POST")
            except _BadRequest:
                self.close_connection = True  # its body stays unread
                raise
            length = self.headers.get("Content-Length")
            if length is None:
                self.close_connection = True
                raise _BadRequest(HTTPStatus.LENGTH_REQUIRED, "a numeric Content-Length header is required")
            if not _LENGTH_RE.fullmatch(length.strip()):
                self.close_connection = True
                message = f"Content-Length must be a number of bytes in ASCII digits, got {length[:40]!r}"
                raise _BadRequest(HTTPStatus.BAD_REQUEST, message)
            length = int(length.strip())
            if length > limits.max_body_bytes:
                self._discard(length)  # so the client can read the 413 instead of a reset
                raise _BadRequest(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"body of {length} bytes exceeds the limit of {limits.max_body_bytes}",
                )
            queries, topk, return_scores = parse_request(self._read_body(length), limits)
        except _BadRequest as err:
            return self._refuse(err)
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
        self.batcher = BatchingRetriever(retriever, limits.max_batch_queries)
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
