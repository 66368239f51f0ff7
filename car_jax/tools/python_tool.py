"""The code-interpreter tool with SimpleTIR's conventions, over `sandbox.run_python`.

- Action: the first fenced block of a reply, opened by ```python, ```py or a bare ```
  (SimpleTIR's pattern), up to the next ``` ; the code is stripped.
- The program has `final_answer(x)` predefined: it prints `\\boxed{x}`.
- Observation: `Code execution result: <stdout>`, the text cut to 512 characters by keeping
  the head and the tail around a marker. On failure (non-zero exit, timeout, output cap) it
  is the last non-empty stderr line instead (car_jax decides failure by the exit status;
  SimpleTIR by "stderr is non-empty", which turns warnings into errors); a failure that left
  no stderr (killed by a signal) is described in words. Empty output gives
  `Code execution result: ` with nothing after it. The rollout adds the separators.
- `PythonTool.run` executes the programs of one turn concurrently (a thread per call, each
  waiting on its own subprocess); `PythonTool.submit` hands back one future per program, so
  the episode loop's `call_tool` gives each row its own result or its own timeout (every
  program also has its own time limit inside the sandbox).
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
from typing import Sequence

from car_jax.tools.sandbox import SandboxConfig, SandboxResult, run_python

OBSERVATION_PREFIX = "Code execution result: "
MAX_OBSERVATION_CHARS = 512
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL)


def extract_code(reply: str) -> str | None:
    """The first fenced Python block of a model reply, or None when there is none."""
    match = _CODE_BLOCK.search(reply)
    return match.group(1).strip() if match else None


def truncate_middle(text: str, max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """Keep head and tail of `text` (at most `max_chars` in all, marker included)."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} chars cut]...\n"
    keep = max(max_chars - len(marker), 0)
    return text[: keep - keep // 2] + marker + text[len(text) - keep // 2 :]


def _signal_words(exit_code: int | None) -> str:
    if exit_code is None or exit_code <= 128:
        return f"exit status {exit_code}"
    try:
        name = signal.Signals(exit_code - 128).name
    except ValueError:
        return f"exit status {exit_code}"
    why = {"SIGKILL": "CPU time or memory limit", "SIGXCPU": "CPU time limit",
           "SIGXFSZ": "file size limit", "SIGSEGV": "segmentation fault"}.get(name)
    return f"killed by {name}" + (f" ({why})" if why else "")


def error_line(result: SandboxResult, config: SandboxConfig) -> str:
    """One line saying why a failed run failed."""
    if result.timed_out:
        return f"TimeoutError: execution exceeded the time limit of {config.timeout_s:g} s"
    if result.output_limited:
        return f"OutputLimitError: output exceeded {config.max_output_bytes} bytes"
    if result.memory_limited:
        return f"MemoryError: the program's processes together exceeded {config.call_memory_mb} MB"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else _signal_words(result.exit_code)


def format_observation(result: SandboxResult, config: SandboxConfig = SandboxConfig(),
                       max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """SandboxResult -> `Code execution result: ...` (see the module doc)."""
    text = result.stdout if result.ok else error_line(result, config)
    return OBSERVATION_PREFIX + truncate_middle(text, max_chars)


class PythonTool:
    """Runs the code blocks of one turn in parallel sandboxes."""

    def __init__(self, config: SandboxConfig = SandboxConfig(), max_workers: int | None = None):
        self.config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers or max(2, os.cpu_count() or 2), thread_name_prefix="sandbox"
        )

    def run(self, codes: Sequence[str | None]) -> list[SandboxResult | None]:
        """codes [B] (None = nothing to run) -> results [B] (None where code was None)."""
        futures = [None if c is None else self._pool.submit(run_python, c, self.config) for c in codes]
        return [None if f is None else f.result() for f in futures]

    def _observe(self, code: str) -> str:
        return format_observation(run_python(code, self.config), self.config)

    def submit(self, codes: Sequence[str]) -> list[concurrent.futures.Future]:
        """Extracted code [B] -> futures [B] of observations, each done when its program ends."""
        return [self._pool.submit(self._observe, c) for c in codes]

    def __call__(self, codes: Sequence[str]) -> list[str]:
        """The batched tool form: extracted code [B] -> observations [B]."""
        return [f.result() for f in self.submit(codes)]

    def observe(self, replies: Sequence[str]) -> list[str | None]:
        """Model replies [B] -> observations [B]; None where a reply holds no code block."""
        results = self.run([extract_code(r) for r in replies])
        return [None if r is None else format_observation(r, self.config) for r in results]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
