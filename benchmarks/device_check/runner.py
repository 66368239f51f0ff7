"""Running the sections with time boxes: a parent process that never imports jax, and a
child process that runs the sections one after another.

The child prints its progress as protocol lines (PREFIX + JSON: the device, a section's
start, a partial result, a section's end) among its ordinary output, which the parent
passes through. The parent gives each section a time box from its start; a section past
its box (or a child that dies) is recorded with whatever partial results it sent, the
child's process group is killed, and a fresh child runs the sections after it. Boxes are
cut to what is left of the whole run's budget, so the run never outlasts it; sections
that no budget is left for are skipped. After each section the parent rewrites the JSON
file, so a run stopped from outside leaves what it had.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pkgutil
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from . import SECTIONS
from .common import Options, device_summary

PREFIX = "@@gpu_check "
# seconds per section at full shapes on one H200, and the whole run's budget (the issue's
# bound is 8 minutes, 480 s, start-up and the parent included)
FULL_BOXES = {"parity": 60, "attention": 45, "decode": 100, "train_step": 80, "engine": 45, "recipe": 100}
FULL_BUDGET = 450.0
# tiny shapes on a CPU: generous boxes (they catch a hang, not a slow machine)
TINY_BOXES = {name: 150 for name in SECTIONS}
TINY_BUDGET = 600.0
STARTUP_BOX = 90.0  # a child's imports and backend start, before its first section
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0"  # tiny CPU runs are compile-bound (tests/conftest.py)


def _sleep(opts: Options, part) -> dict:
    """A section that never ends in time (the tests' proof that a box is enforced)."""
    part("sleeping", True)
    time.sleep(3600)
    return {"checks": {}}


HIDDEN = {"_sleep": _sleep}


def accelerator_installed() -> bool:
    """Whether jax could find an accelerator here, guessed without starting a backend (that
    would take the GPU's memory in the parent): JAX_PLATFORMS=cpu says no; a jax plugin
    (CUDA, ROCm) or libtpu says maybe."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    try:
        import jax_plugins
        if any(True for _ in pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    except ImportError:
        pass
    return importlib.util.find_spec("libtpu") is not None


# -- the child ------------------------------------------------------------------------------
def emit(event: dict) -> None:
    print(PREFIX + json.dumps(event, default=str), flush=True)


def status_of(result: dict) -> str:
    checks = result.get("checks", {})
    if not checks and "skipped" in result:
        return "skipped"
    return "ok" if all(c["ok"] for c in checks.values()) else "failed"


def child(names: list[str], shapes: str, work: Path, assets: Path | None) -> None:
    """Runs `names` in order in this process, printing protocol lines. shapes: tiny, full,
    or auto (tiny on a CPU)."""
    dev = device_summary()
    tiny = shapes == "tiny" or (shapes == "auto" and dev["backend"] == "cpu")
    emit({"device": dev, "tiny": tiny})
    opts = Options(tiny=tiny, work=work, assets=assets)
    for name in names:
        emit({"start": name})
        start = time.perf_counter()
        run = HIDDEN.get(name) or SECTIONS[name].run
        try:
            result = run(opts, lambda key, value, name=name: emit({"part": name, "key": key, "value": value}))
            result["status"] = status_of(result)
        except Exception as e:  # noqa: BLE001 - one section's error is its result; the next one runs
            traceback.print_exc()
            result = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000], "checks": {}}
        result["seconds"] = time.perf_counter() - start
        emit({"end": name, "result": result})


# -- the parent -----------------------------------------------------------------------------
def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _kill(proc: subprocess.Popen) -> None:
    """Ends the child and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Run:
    """One run of the check: the sections' results as they come, written to `out` after each."""

    def __init__(self, names: list[str], child_args: list[str], out: Path, budget: float | None,
                 boxes: dict[str, float], shapes: str, echo: Callable[[str], None] = print):
        self.names, self.child_args, self.out, self.echo = names, child_args, out, echo
        self.shapes, self.boxes_given, self.budget_given = shapes, boxes, budget
        self.start = time.monotonic()
        self.record: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}
        self.tiny: bool | None = None

    # what the child's mode decides
    def box(self, name: str) -> float:
        base = (TINY_BOXES if self.tiny else FULL_BOXES).get(name, 60.0)
        return float(self.boxes_given.get(name, base))

    @property
    def budget(self) -> float:
        if self.budget_given is not None:
            return self.budget_given
        return TINY_BUDGET if self.tiny else FULL_BUDGET

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def finish(self, name: str, result: dict) -> None:
        self.record["sections"][name] = result
        line = f"[gpu_check] {name}: {result['status']} in {result.get('seconds', 0.0):.1f} s: {headline(name, result)}"
        bad = [k for k, c in result.get("checks", {}).items() if not c["ok"]]
        if bad:
            line += f"\n[gpu_check]   failed checks: {', '.join(bad)}"
        self.echo(line)
        self.echo(f"[gpu_check] {name} " + json.dumps(clean(result)))
        self.write()

    def write(self) -> None:
        self.record["total_s"] = time.monotonic() - self.start
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(clean(self.record), indent=1, allow_nan=False))

    def go(self) -> dict:
        pending = list(self.names)
        while pending:
            if self.tiny is not None and self.left() <= 1.0:
                for name in pending:
                    self.finish(name, {"status": "skipped", "error": "no time left in the run's budget "
                                       f"({self.budget:.0f} s)", "seconds": 0.0})
                break
            done = self.one_child(pending)
            pending = [n for n in pending if n not in self.record["sections"]]
            if not done:  # the child died before any section started: the rest would too
                for name in pending:
                    self.finish(name, {"status": "crashed", "error": "the child process ended before the section "
                                       "started (see its output above)", "seconds": 0.0})
                break
        self.write()
        return self.record

    def one_child(self, names: list[str]) -> bool:
        """Runs `names` in one child until it ends or a box runs out; False if it ran none."""
        shapes = self.shapes if self.tiny is None else ("tiny" if self.tiny else "full")
        cmd = [sys.executable, *self.child_args, "--child", "--sections", ",".join(names), "--shapes", shapes]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current, parts, started_any = None, {}, False
        deadline = time.monotonic() + STARTUP_BOX
        box = STARTUP_BOX
        while True:
            limit = deadline if self.tiny is None else min(deadline, self.start + self.budget)
            try:
                line = lines.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                _kill(proc)
                if current is None:
                    self.echo(f"[gpu_check] the child started no section in {STARTUP_BOX:.0f} s; killed")
                    return started_any
                over = "its time box" if limit == deadline else "the run's budget"
                self.finish(current, {"status": "timeout", "box_s": box, "parts": parts,
                                      "error": f"ran past {over} ({box:.0f} s); killed",
                                      "seconds": time.monotonic() - (deadline - box), "checks": {}})
                return True
            if line is None:  # the child ended
                rc = proc.wait()
                if current is not None:
                    self.finish(current, {"status": "crashed", "error": f"the child process ended with code {rc}",
                                          "parts": parts, "seconds": time.monotonic() - (deadline - box),
                                          "checks": {}})
                return started_any
            if not line.startswith(PREFIX):
                self.echo(line.rstrip("\n"))
                continue
            event = json.loads(line[len(PREFIX):])
            if "device" in event:
                self.tiny = event["tiny"]
                self.record.update(device=event["device"], shapes="tiny" if self.tiny else "full",
                                   budget_s=self.budget)
                self.echo(f"[gpu_check] {event['device']}, {'tiny' if self.tiny else 'full'} shapes, "
                          f"budget {self.budget:.0f} s")
            elif "start" in event:
                current, parts, started_any = event["start"], {}, True
                box = min(self.box(current), max(self.left(), 0.0))
                deadline = time.monotonic() + box
            elif "part" in event:
                parts[event["key"]] = event["value"]
            elif "end" in event:
                result = {**event["result"], "box_s": box}
                self.finish(event["end"], result)
                current = None
                deadline, box = time.monotonic() + STARTUP_BOX, STARTUP_BOX  # until the next start


def clean(x):
    """x with NaN and infinities as None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def markdown(record: dict) -> str:
    """The run as a short markdown table (section, status, seconds, summary)."""
    dev = record.get("device", {})
    lines = [f"Device check on {dev.get('device_kind', '?')} ({dev.get('backend', '?')}, jax {dev.get('jax', '?')}), "
             f"{record.get('shapes', '?')} shapes, {record.get('total_s', 0.0):.0f} s in all", "",
             "| section | status | seconds | result |", "|---|---|---:|---|"]
    for name, r in record["sections"].items():
        text = headline(name, r).replace("|", "/")
        lines.append(f"| {name} | {r['status']} | {r.get('seconds') or 0.0:.1f} | {text} |")
    return "\n".join(lines)


def headline(name: str, result: dict) -> str:
    """The section's one-line summary, or its error."""
    if result.get("error"):
        return result["error"].splitlines()[0]
    if name in SECTIONS:
        try:
            return SECTIONS[name].summary(result)
        except Exception as e:  # noqa: BLE001 - a summary that cannot be written must not lose the result
            return f"(no summary: {type(e).__name__}: {e})"
    return ""
