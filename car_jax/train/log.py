"""Training metrics: one JSON line per step, the loggers of `run.loggers`, a progress bar, timers.

    timer = Timer()
    with MetricsLogger(run_dir, loggers=("tensorboard", "wandb"), wandb=WandbConfig(mode="offline"),
                       config=dump_config(cfg), progress=Progress(200, initial_step=start)) as log:
        for step in range(start + 1, 201):
            with timer("rollout"):
                ...
            with timer("update"):
                state, m = train_step(state, batch); jax.block_until_ready(m)
            log.log(step, {**m, **timer.split()}, samples=[Sample(...), ...])

`run_dir/metrics.jsonl` holds `{"step": s, "time": unix_seconds, **metrics}` per line, whatever
the loggers. Each line is flushed when written, so a crash loses at most the line being written;
`read_metrics` skips a truncated last line. Non-finite floats are written as the strings
"NaN", "Infinity", "-Infinity" (the file stays strict JSON) and read back as floats.

The config keys (`train.config.RunConfig`):
  run.loggers           where the metrics go besides metrics.jsonl: any of "tensorboard" (event
                        files in run_dir/tb, tensorboardX) and "wandb" (Weights & Biases, the
                        `wandb` extra), [] for none; default ["tensorboard"]. On the command line
                        `run.loggers=[tensorboard,wandb]`. Each logger gets the same metric names
                        and steps as metrics.jsonl, and the step's samples as a table
                        (`loggers.Sample`: prompt, response, gold, reward, correct, confidence;
                        W&B: a wandb.Table "samples"; TensorBoard: text "samples/text_summary").
  run.tensorboard       deprecated, superseded by run.loggers: false = no "tensorboard" in the
                        default list; a value that contradicts run.loggers is an error.
  run.samples_per_step  the first N trajectories of a step (the writer's rows) logged as its
                        samples; 0: none.
  run.wandb.{project, entity, name, group, tags, mode}
                        the W&B run (`loggers.WandbConfig`; null: the WANDB_* variable).
Only the writer process (`hosts.is_writer`: jax.process_index() == 0) builds a MetricsLogger;
the others get a NullLogger. The sinks themselves are in `train/loggers.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from car_jax.train.loggers import Sample, WandbConfig, open_sinks

__all__ = ["MetricsLogger", "NullLogger", "Progress", "Sample", "Timer", "read_metrics", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _scalar(key: str, value: Any) -> int | float:
    """A metric value as a Python int/float: accepts numbers, numpy and 0-d jax arrays."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    size = getattr(value, "size", None)
    if size is not None and size != 1:
        raise ValueError(f"metric {key!r} has shape {getattr(value, 'shape', '?')}; log "
                         f"scalars only (reduce it first, e.g. with .mean())")
    try:
        item = value.item() if hasattr(value, "item") else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {key!r} = {value!r} ({type(value).__name__}) is not a "
                         f"number") from None
    return int(item) if isinstance(item, (bool, int)) else float(item)


def _json_value(x: int | float) -> int | float | str:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


@dataclasses.dataclass(frozen=True)
class Progress:
    """A MetricsLogger's tqdm bar (with ETA): its length, where it starts, what it shows."""
    total_steps: int  # the last step number
    initial_step: int = 0  # the bar's starting position (the step a resumed run restarts after)
    desc: str = "train"  # the bar's label
    show: tuple[str, ...] = ("reward", "accuracy", "ece", "kl")  # metric keys shown in its postfix when present


class MetricsLogger:
    """Writes per-step metrics to `run_dir/metrics.jsonl`, the chosen loggers and a tqdm bar.

    Args:
      run_dir: the run's folder (created if missing). An existing metrics file is appended
        to (resume); a partial last line left by a crash is removed first.
      loggers: names from `loggers.LOGGERS` ("tensorboard": run_dir/tb; "wandb": a W&B run),
        each fed every step's metrics and samples; () for the JSONL alone.
      wandb: the W&B run's settings when loggers lists "wandb" (default: all from WANDB_*).
      config: the run's config as plain data (`config.dump_config`), recorded by W&B once.
      progress: the progress bar (`Progress`: last step, starting step, label, metric keys
        shown); None: no bar.
      truncate_after: when resuming from a checkpoint at this step, drop the lines with a
        larger step (they were logged after the checkpoint and will be logged again).
    """

    def __init__(self, run_dir: str | os.PathLike, *, loggers: Sequence[str] = ("tensorboard",),
                 wandb: WandbConfig | None = None, config: Mapping[str, Any] | None = None,
                 progress: Progress | None = None, truncate_after: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.show = tuple(progress.show) if progress is not None else ()
        self._sinks = open_sinks(tuple(loggers), self.run_dir, wandb, config)  # first: one may fail to open
        try:
            _repair(self.path, truncate_after)
            self._file = open(self.path, "a", encoding="utf-8")
        except BaseException:
            for sink in self._sinks:
                sink.close()
            raise
        self._bar = None
        if progress is not None:
            self._bar = tqdm(total=progress.total_steps, initial=progress.initial_step, desc=progress.desc,
                             dynamic_ncols=True, unit="step")

    def log(self, step: int, metrics: Mapping[str, Any], samples: Sequence[Sample] = ()) -> None:
        """Records `metrics` (name -> scalar) for `step`: one JSON line, each logger (with the
        step's `samples`, if any), the bar."""
        step = int(step)
        values = {}
        for key, value in metrics.items():
            if key in ("step", "time"):
                raise ValueError(f"metric name {key!r} is reserved for the record itself; "
                                 f"rename it")
            values[str(key)] = _scalar(str(key), value)
        record = {"step": step, "time": time.time(),
                  **{k: _json_value(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.log(step, values, tuple(samples))
        if self._bar is not None:
            shown = {k: f"{values[k]:.4g}" for k in self.show if k in values}
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            else:
                self._bar.refresh()

    def close(self) -> None:
        """Flushes and closes the file, the loggers and the bar (idempotent)."""
        if not self._file.closed:
            self._file.close()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger:
    """A MetricsLogger that writes nothing: what the processes other than the writer of a
    multi-process run log to (`hosts.is_writer`)."""

    def log(self, step: int, metrics: Mapping[str, Any], samples: Sequence[Sample] = ()) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def _repair(path: Path, truncate_after: int | None) -> None:
    """Drops a partial last line (a crash mid-write) and, optionally, lines after a step."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    keep = data if data.endswith(b"\n") else data[:data.rfind(b"\n") + 1]
    if truncate_after is not None:
        lines = keep.decode("utf-8").splitlines(keepends=True)
        kept = [ln for ln in lines if (r := _parse(ln)) is None
                or int(r.get("step", 0)) <= truncate_after]
        keep = "".join(kept).encode("utf-8")
    if keep != data:
        if not data.endswith(b"\n"):
            warnings.warn(f"{path}: dropped a partial last line (a run stopped mid-write)",
                          stacklevel=3)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(keep)
        os.replace(tmp, path)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Reads `run_dir/metrics.jsonl` back as a list of dicts, in file order.

    A truncated last line (a crash mid-write) is skipped; a bad line elsewhere raises
    ValueError naming the line number. Missing file -> FileNotFoundError.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}; is {run_dir} a run folder?")
    lines = path.read_text(encoding="utf-8").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record = _parse(line)
        if record is None:
            if i == len(lines) - 1:  # last line without its newline: truncated write
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {line[:80]!r}")
        out.append(record)
    return out


class Timer:
    """Accumulates wall seconds per phase between `split()` calls.

        with timer("rollout"): ...      # may be entered many times per step
        timer.split()  # -> {"time/rollout": s, ..., "time/step": since last split}; resets

    JAX dispatches asynchronously: block on a phase's outputs inside its `with` block
    (`jax.block_until_ready`), or its device time is charged to the next phase.
    """

    def __init__(self, prefix: str = "time/"):
        self.prefix = prefix
        self._acc: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase == "step":
            raise ValueError("phase name 'step' is reserved for the whole step's time; "
                             "pick another name")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._acc[phase] = self._acc.get(phase, 0.0) + time.perf_counter() - t0

    def split(self) -> dict[str, float]:
        """Returns seconds per phase (keys `prefix + phase`) plus `prefix + "step"`, the
        wall time since the previous split (or construction), and resets."""
        now = time.perf_counter()
        out = {self.prefix + k: v for k, v in self._acc.items()}
        out[self.prefix + "step"] = now - self._start
        self._acc = {}
        self._start = now
        return out
