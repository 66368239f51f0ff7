"""Shared helpers for the side-by-side benchmarks."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from datetime import date


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def header(title: str, command: str) -> str:
    return f"### {title}\n\n`{command}` on {machine()}, {date.today().isoformat()}\n"


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Best wall time of `repeats` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result
