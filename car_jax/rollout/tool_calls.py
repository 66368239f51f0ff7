"""Host-side tool calls of the episode loop: one batched call per tool kind and turn, each
failure (an exception, a timeout, a wrong result count) turned into an observation text
instead of ending the episode."""
from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

from car_jax.rollout.protocols import INVALID, VOID, Action

Tool = Callable[[list[str]], list[str]]  # batched: one result text per request


def call_tool(tool: Tool, name: str, requests: list[str], timeout_s: float) -> list[tuple[str, str | None]]:
    """Runs one batched tool call; returns (result text, error or None) per request.
    An exception or a timeout becomes a result text instead of ending the episode."""
    pool = cf.ThreadPoolExecutor(max_workers=1)
    try:
        results = pool.submit(tool, list(requests)).result(timeout=timeout_s)
        if len(results) != len(requests):
            raise RuntimeError(f"tool {name!r} returned {len(results)} results for {len(requests)} requests")
        return [(str(r), None) for r in results]
    except cf.TimeoutError:
        err = f"{name} failed: timed out after {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - any tool crash becomes an observation
        err = f"{name} failed: {type(exc).__name__}: {exc}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [(err, err)] * len(requests)


def run_tools(actions: dict[int, Action], tools: dict[str, Tool], timeout_s: float,
               trajs: list[Trajectory]) -> dict[int, str]:
    """Calls each tool once for all rows that asked for it; logs every call."""
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
