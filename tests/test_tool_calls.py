"""call_tool: a deadline fails only the rows whose results are not there; a tool that is one
batched computation still fails as a whole."""
import concurrent.futures as cf
import threading
import time

from car_jax.rollout.tool_calls import RowTool, call_tool
from car_jax.tools.python_tool import PythonTool
from car_jax.tools.sandbox import SandboxConfig


class RowFake:
    """One future per request: "ok:x" resolves at once to "X", "boom" raises, "hang" stays
    pending until `release` is set (after the test)."""

    def __init__(self, workers: int = 4):
        self.release = threading.Event()
        self.pool = cf.ThreadPoolExecutor(max_workers=workers)
        self.started: list[str] = []

    def _one(self, request: str) -> str:
        self.started.append(request)
        if request == "boom":
            raise ValueError("bad row")
        if request == "hang":
            self.release.wait(30)
            return "late"
        return request.removeprefix("ok:").upper()

    def submit(self, requests):
        return [self.pool.submit(self._one, r) for r in requests]

    def __call__(self, requests):  # the whole batch: waits for its slowest row
        return [f.result() for f in self.submit(requests)]


def test_a_slow_row_fails_alone():
    tool = RowFake()
    assert isinstance(tool, RowTool)
    try:
        out = call_tool(tool, "code", ["ok:a", "hang", "boom", "ok:b"], timeout_s=0.3)
    finally:
        tool.release.set()
        tool.pool.shutdown(wait=True)
    timeout = "code failed: timed out after 0.3 s"
    assert out == [("A", None), (timeout, timeout),
                   ("code failed: ValueError: bad row", "code failed: ValueError: bad row"), ("B", None)]


def test_a_row_queued_past_the_deadline_is_cancelled():
    tool = RowFake(workers=1)  # "hang" runs, "ok:late" waits behind it
    try:
        out = call_tool(tool, "code", ["hang", "ok:late"], timeout_s=0.2)
    finally:
        tool.release.set()
        tool.pool.shutdown(wait=True)
    assert [err for _, err in out] == ["code failed: timed out after 0.2 s"] * 2
    assert tool.started == ["hang"]  # the queued row never ran


def test_a_batched_tool_fails_as_a_whole():
    def batch(queries):  # one computation for all rows: nothing to hand out early
        time.sleep(2)
        return [q.upper() for q in queries]

    timeout = "search failed: timed out after 0.2 s"
    assert call_tool(batch, "search", ["a", "b"], timeout_s=0.2) == [(timeout, timeout)] * 2
    short = "search failed: RuntimeError: tool 'search' returned 1 results for 2 requests"
    assert call_tool(lambda qs: ["x"], "search", ["a", "b"], timeout_s=5) == [(short, short)] * 2
    assert call_tool(lambda qs: [q * 2 for q in qs], "search", ["a", "b"], 5) == [("aa", None), ("bb", None)]


def test_python_tool_rows_end_on_their_own():
    with PythonTool(SandboxConfig(timeout_s=2.5), max_workers=3) as tool:
        out = call_tool(tool, "code", ["print(6 * 7)", "import time\ntime.sleep(30)", "1 / 0"], timeout_s=1.5)
    timeout = "code failed: timed out after 1.5 s"
    assert out == [("Code execution result: 42\n", None), (timeout, timeout),
                   ("Code execution result: ZeroDivisionError: division by zero", None)]


def test_rows_queued_behind_slow_programs_still_run():
    # one worker, five programs that each run into the sandbox's own 1 s limit: the innocent
    # row starts after at least 5 s, past the call's 4 s; its time counts from its start
    sleeper, innocent = "import time\ntime.sleep(60)", "print('ran')"
    with PythonTool(SandboxConfig(timeout_s=1), max_workers=1) as tool:
        out = call_tool(tool, "code", [sleeper] * 5 + [innocent], timeout_s=4)
    own_timeout = "Code execution result: TimeoutError: execution exceeded the time limit of 1 s"
    assert out == [(own_timeout, None)] * 5 + [("Code execution result: ran\n", None)]
