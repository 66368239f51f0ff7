"""`BatchingRetriever`: the searches of many threads served by one backend thread, in fair
batches.

Requests wait in a queue. The worker builds each batch of at most `max_batch_queries`
queries by taking a slice of every waiting request in turn, an equal share each (round
robin, in arrival order), and searches the batch in one backend call (one encoder call) at
the largest topk asked for; each request gets its own rows, cut to its own topk, once its
last slice is done. So many small requests cost about as much as one big one, and a small
request waits for the batch in flight and the next one, not for every big request queued
before it. A backend error fails each request with a slice in that batch. The backend is
only ever called from the worker thread.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading

from car_jax.tools.corpus import Doc
from car_jax.tools.retriever import Retriever, SearchError


@dataclasses.dataclass(eq=False)
class _Request:
    queries: list[str]  # [Q]
    topk: int
    future: concurrent.futures.Future
    sent: int = 0  # queries[:sent] are in a batch already
    rows: list = dataclasses.field(default_factory=list)  # results of the served slices


class BatchingRetriever(Retriever):
    """Serializes and coalesces `search` calls from many threads onto one backend thread."""

    def __init__(self, base: Retriever, max_batch_queries: int = 256):
        if max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be >= 1, got {max_batch_queries}")
        self.base, self.max_batch = base, max_batch_queries
        self._waiting: collections.deque[_Request] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="retriever-batcher", daemon=True)
        self._worker.start()

    def submit(self, queries: list[str], topk: int) -> concurrent.futures.Future:
        """Queue one request of cleaned queries [Q]; the future resolves to Q lists of docs."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not queries:
            future.set_result([])
            return future
        with self._cond:
            if self._closed:
                raise SearchError("the retriever is closed")
            self._waiting.append(_Request(list(queries), topk, future))
            self._cond.notify()
        return future

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        return self.submit(queries, topk).result()

    def _next_batch(self) -> list[tuple[_Request, int, int]] | None:
        """Wait for work, then take (request, start, stop) slices: passes over the waiting
        requests, each getting an equal share of the room left, until the batch is full or
        nothing waits. None once closed and drained."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            slices: dict[_Request, list[int]] = {}
            room = self.max_batch
            while room and self._waiting:
                share = max(1, room // len(self._waiting))
                for _ in range(len(self._waiting)):
                    if not room:
                        break
                    req = self._waiting.popleft()
                    take = min(share, room, len(req.queries) - req.sent)
                    slices.setdefault(req, [req.sent, req.sent])[1] += take
                    req.sent += take
                    room -= take
                    if req.sent < len(req.queries):
                        self._waiting.append(req)  # to the back of the line
            return [(req, start, stop) for req, (start, stop) in slices.items()] or None

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._serve(batch)

    def _serve(self, batch: list[tuple[_Request, int, int]]) -> None:
        queries = [q for req, start, stop in batch for q in req.queries[start:stop]]
        try:
            results = self.base.search(queries, max(req.topk for req, _, _ in batch))
        except BaseException as err:  # hand the failure to every request in the batch
            with self._cond:
                for req, _, _ in batch:
                    if req in self._waiting:
                        self._waiting.remove(req)
                    if not req.future.done():  # (close() may have failed it already)
                        req.future.set_exception(err)
            return
        done = 0
        for req, start, stop in batch:
            req.rows.extend(docs[: req.topk] for docs in results[done : done + stop - start])
            done += stop - start
            if len(req.rows) == len(req.queries) and not req.future.done():
                req.future.set_result(req.rows)

    def close(self) -> None:
        """Serve what is queued, then stop; later searches raise SearchError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(timeout=10)
        with self._cond:  # the worker is stuck in the backend: do not leave callers waiting
            for req in self._waiting:
                req.future.set_exception(SearchError("the retriever closed before this search ran"))
            self._waiting.clear()
