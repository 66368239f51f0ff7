"""The retriever interface shared by the in-process backends, the HTTP client and wrappers.

    retriever.search(queries: list[str], topk: int) -> list[list[Doc]]   # one list per query
    retriever.observe(queries, topk) -> list[str]                        # text for the model
    retriever(queries) -> list[str]                                      # observe, topk 3

`search` is batched over all rows of a turn. Queries are cleaned the same way everywhere:
non-strings are rejected, whitespace is squeezed, and queries longer than `MAX_QUERY_CHARS`
are cut (the encoders truncate to at most 512 tokens anyway). An empty query is allowed and
returns the backend's best guesses (BM25: zero-score docs). `observe` renders each row with
`render_docs`; a `SearchError` (server down, timeout, bad reply) becomes the row text
`SEARCH_FAILED_PREFIX + reason` instead of an exception, so one dead server cannot crash a
rollout.
"""
from __future__ import annotations

import abc
from typing import Sequence

from car_jax.tools.corpus import Doc, render_docs

MAX_QUERY_CHARS = 2048
SEARCH_FAILED_PREFIX = "Search failed: "


class SearchError(RuntimeError):
    """The search backend could not answer (network, server, or reply format)."""


def clean_queries(queries: Sequence[str], max_chars: int = MAX_QUERY_CHARS) -> list[str]:
    """Validate and normalize queries: str only, whitespace squeezed, cut to `max_chars`."""
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings, got one str: wrap it as [query]")
    out = []
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise TypeError(f"query {i} is {type(q).__name__}, expected str")
        out.append(" ".join(q.split())[:max_chars])
    return out


def check_topk(topk: int) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return topk


class Retriever(abc.ABC):
    """Base class: subclasses implement `_search` on cleaned queries."""

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Doc]]:
        """queries [B] -> B lists of at most `topk` docs, best first."""
        queries = clean_queries(queries)
        topk = check_topk(topk)
        if not queries:
            return []
        results = self._search(queries, topk)
        if len(results) != len(queries):
            raise SearchError(f"backend returned {len(results)} result lists for {len(queries)} queries")
        return results

    @abc.abstractmethod
    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        ...

    def observe(self, queries: Sequence[str], topk: int = 3, strip_title_quotes: bool = False) -> list[str]:
        """queries [B] -> B rendered observations; a SearchError becomes failure text."""
        try:
            results = self.search(queries, topk)
        except SearchError as err:
            return [f"{SEARCH_FAILED_PREFIX}{err}" for _ in queries]
        return [render_docs(docs, strip_title_quotes) for docs in results]

    def __call__(self, queries: Sequence[str], topk: int = 3) -> list[str]:
        """The batched tool form the episode loop calls: queries [B] -> observations [B]."""
        return self.observe(queries, topk)

    def close(self) -> None:
        """Release files, threads or connections (no-op by default)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
