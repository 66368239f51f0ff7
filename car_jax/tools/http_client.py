"""Client for a Search-R1 style retrieval server (ours or Search-R1's own `retrieval_server.py`).

Request: POST <url> `{"queries": [...], "topk": k, "return_scores": true}`.
Reply: `{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`; the
no-score form (a bare list of documents per query) is accepted too.

Standard library only (urllib). Connection errors, timeouts and 5xx replies are retried with
exponential backoff; 4xx replies are not (the request itself is wrong). When every attempt
fails, `search` raises SearchError and `observe` returns "Search failed: ..." rows.
Proxy variables from the environment are ignored unless `use_env_proxy=True`: a loopback
retriever must not be sent through an HTTP proxy.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

from car_jax.tools.corpus import Doc, doc_from_json
from car_jax.tools.retriever import Retriever, SearchError


def normalize_url(url: str) -> str:
    """'host:port', 'http://host:port' or a full '/retrieve' URL -> the /retrieve URL."""
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else url + "/retrieve"


class HttpRetriever(Retriever):
    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        use_env_proxy: bool = False,
    ):
        self.url = normalize_url(url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
        self._opener = urllib.request.build_opener(*handlers)

    def _post(self, payload: dict) -> dict:
        body = json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with self._opener.open(request, timeout=self.timeout_s) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as err:
                detail = err.read(500).decode("utf-8", "replace")
                last = f"HTTP {err.code} from {self.url}: {detail}"
                if err.code < 500:
                    break  # our request is at fault: retrying will not help
            except (OSError, http.client.HTTPException) as err:  # URLError, timeouts, resets
                reason = getattr(err, "reason", err)
                last = f"cannot reach {self.url} ({type(reason).__name__}: {reason})"
            except json.JSONDecodeError as err:
                last = f"reply from {self.url} is not JSON ({err.msg})"
        raise SearchError(last)

    def _search(self, queries: list[str], topk: int) -> list[list[Doc]]:
        reply = self._post({"queries": queries, "topk": topk, "return_scores": True})
        rows = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(rows, list) or len(rows) != len(queries):
            raise SearchError(f"reply from {self.url} lacks a 'result' list with one row per query")
        try:
            return [[_parse_item(item, i) for i, item in enumerate(row)] for row in rows]
        except (ValueError, TypeError, KeyError) as err:
            raise SearchError(f"bad document in reply from {self.url}: {err}") from None


def _parse_item(item, i: int) -> Doc:
    if isinstance(item, dict) and "document" in item:
        score = item.get("score")
        return doc_from_json(item["document"], i, None if score is None else float(score))
    return doc_from_json(item, i)
