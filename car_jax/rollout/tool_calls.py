"""Host-side tool calls of the episode loop: one batched call per tool kind and turn, each
failure (an exception, a timeout, a wrong result count) turned into an observation text
instead of ending the episode.

What a deadline (`timeout_s`) fails depends on what the tool can tell apart:
- a `RowTool` also has `submit(requests) -> [Future]`, one future per request (PythonTool:
  every program runs in its own sandbox, under its own time limit). It is waited on row by
  row, and each row's deadline counts from when that row started running: a row whose
  future is done gets its result, or its own error if it raised; a row still running
  `timeout_s` after it started gets the timeout error. Rows queued behind slow ones (more
  rows than the tool has workers) wait for a worker without losing time, so slow rows fail
  alone; a queued row fails (and is cancelled) only when no row of the call has started
  or ended for `timeout_s`. The whole call can then take longer than `timeout_s`: about
  rows / workers program time limits.
- any other tool is one batched computation (a retriever encodes and searches all queries
  at once): no row has a result before the whole batch does, so a timeout or an exception
  is every row's error. Splitting such a call per row would lose the batching it exists
  for, and only the tool knows whether its rows are independent: the opt-in is the tool's.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable, Protocol, runtime_checkable

from car_jax.rollout.protocols import INVALID, VOID, Action

Tool = Callable[[list[str]], list[str]]  # batched: one result text per request
POLL_S = 0.05  # how often a RowTool call looks for rows that started


@runtime_checkable
class RowTool(Protocol):
    """A batched tool whose requests are independent and can be awaited one by one."""

    def __call__(self, requests: list[str]) -> list[str]: ...

    def submit(self, requests: list[str]) -> list[cf.Future]:
        """requests [B] -> futures [B], each resolving to that request's result text."""
        ...


def _failed(name: str, exc: BaseException) -> str:
    return f"{name} failed: {type(exc).__name__}: {exc}"


def _timed_out(name: str, timeout_s: float) -> str:
    return f"{name} failed: timed out after {timeout_s:g} s"


def call_tool(tool: Tool, name: str, requests: list[str], timeout_s: float) -> list[tuple[str, str | None]]:
    """Runs one batched tool call; returns (result text, error or None) per request [B].
    An exception or a timeout becomes a result text instead of ending the episode; which
    rows it fails is described in the module doc."""
    if isinstance(tool, RowTool):
        return _call_rows(tool, name, requests, timeout_s)
    pool = cf.ThreadPoolExecutor(max_workers=1)
    try:
        results = pool.submit(tool, list(requests)).result(timeout=timeout_s)
        if len(results) != len(requests):
            raise RuntimeError(f"tool {name!r} returned {len(results)} results for {len(requests)} requests")
        return [(str(r), None) for r in results]
    except cf.TimeoutError:
        err = _timed_out(name, timeout_s)
    except Exception as exc:  # noqa: BLE001 - any tool crash becomes an observation
        err = _failed(name, exc)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [(err, err)] * len(requests)


def _call_rows(tool: RowTool, name: str, requests: list[str], timeout_s: float) -> list[tuple[str, str | None]]:
    """One future per request; each row's deadline counts from when it started running
    (polled every POLL_S), so rows queued behind slow ones still get their time. A row
    that has not started fails (and is cancelled) once no row of the call has started or
    ended for `timeout_s`: the tool's workers are stuck."""
    try:
        futures = tool.submit(list(requests))
        if len(futures) != len(requests):
            raise RuntimeError(f"tool {name!r} returned {len(futures)} futures for {len(requests)} requests")
    except Exception as exc:  # noqa: BLE001
        err = _failed(name, exc)
        return [(err, err)] * len(requests)
    started: dict[int, float] = {}
    expired: set[int] = set()
    waiting = set(range(len(futures)))
    progress = time.monotonic()  # the last time a row started or ended
    while waiting:
        now = time.monotonic()
        for i in list(waiting):
            if futures[i].done():
                waiting.discard(i)
                progress = now
            elif i not in started and futures[i].running():
                started[i] = progress = now
        for i in list(waiting):
            if started.get(i, progress) + timeout_s <= now:
                futures[i].cancel()  # a row that has not started yet never will
                waiting.discard(i)
                expired.add(i)
        if waiting:
            until = min(started.get(i, progress) for i in waiting) + timeout_s
            cf.wait([futures[i] for i in waiting], timeout=min(max(until - now, 0), POLL_S),
                    return_when=cf.FIRST_COMPLETED)
    out: list[tuple[str, str | None]] = []
    for i, future in enumerate(futures):
        if i in expired:
            err = _timed_out(name, timeout_s)
        elif future.exception() is not None:
            err = _failed(name, future.exception())
        else:
            out.append((str(future.result()), None))
            continue
        out.append((err, err))
    return out


def run_tools(actions: dict[int, Action], tools: dict[str, Tool], timeout_s: float,
              trajs: list) -> dict[int, str]:
    """Calls each tool once for all rows that asked for it; logs every call in the rows'
    trajectories (`episode.Trajectory`: n_tool_calls, tool_log)."""
    results: dict[int, str] = {}
    for i, a in actions.items():
        if a.kind not in tools and a.kind not in (VOID, INVALID):
            results[i] = f"{a.kind} failed: no tool named {a.kind!r} in this run (have {sorted(tools)})"
    for name in sorted({a.kind for a in actions.values()} & set(tools)):
        rows = [i for i, a in actions.items() if a.kind == name]
        outs = call_tool(tools[name], name, [actions[i].payload for i in rows], timeout_s)
        for i, (text, err) in zip(rows, outs):
            results[i] = text
            trajs[i].n_tool_calls += 1
            trajs[i].tool_log.append({"tool": name, "request": actions[i].payload, "result": text, "error": err})
    return results
