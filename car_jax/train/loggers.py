"""The metric loggers that `run.loggers` names: TensorBoard and Weights & Biases.

`log.MetricsLogger` always writes `run_dir/metrics.jsonl` (and a progress bar); each name in
`run.loggers` adds one sink here, fed the same step metrics (the JSONL's names, step = the
training step) and the step's trajectory samples (`Sample`, `run.samples_per_step` of them):

  "tensorboard"  tensorboardX event files in run_dir/tb: a scalar per finite metric (NaN and
                 inf stay in the JSONL) and the samples as a markdown table in the Text tab
                 (tag "samples/text_summary": tensorboardX appends the suffix).
  "wandb"        a Weights & Biases run: the run's config once (wandb.config), every metric per
                 step (`run.log(metrics, step=step)`, NaN and inf too) and the samples as a
                 wandb.Table under "samples". Needs the `wandb` extra
                 (`pip install 'car_jax[wandb]'`), imported only when "wandb" is chosen.

W&B settings are the `run.wandb` section (`WandbConfig`); a key left null falls back to wandb's
environment variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, WANDB_RUN_GROUP, WANDB_TAGS,
WANDB_MODE), then to the default its comment names; a key that is set wins over the variable.
The run's files go under $WANDB_DIR, else the run folder (run_dir/wandb/<run>); an offline run
is uploaded later with `wandb sync run_dir/wandb/offline-run-*` and read locally with
`wandb leet inspect run_dir/wandb`. A resumed car_jax run starts a new W&B run whose steps begin
after the checkpoint.
"""
from __future__ import annotations

import dataclasses
import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

from car_jax.config import require

__all__ = ["LOGGERS", "SAMPLE_COLUMNS", "Sample", "WandbConfig", "TensorBoardSink", "WandbSink", "import_wandb",
           "open_sinks", "samples_markdown"]

LOGGERS = ("tensorboard", "wandb")  # the names run.loggers may list
WANDB_MODES = ("online", "offline", "disabled")
DEFAULT_PROJECT = "car_jax"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One trajectory of a step as the loggers show it: the question, the decoded response
    (the model's turns and the tools' observations), the gold answers joined by " | ", the
    reward, whether the answer was graded correct and the stated confidence (0 when missing)."""
    prompt: str
    response: str
    gold: str
    reward: float
    correct: bool
    confidence: float


SAMPLE_COLUMNS = tuple(f.name for f in dataclasses.fields(Sample))


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """run.wandb: the W&B run, read when run.loggers lists "wandb". A null key falls back to
    wandb's environment variable, then to the default named here."""
    project: str | None = None  # null: $WANDB_PROJECT, else "car_jax"
    entity: str | None = None  # the team or user; null: $WANDB_ENTITY, else your default entity
    name: str | None = None  # the run's display name; null: $WANDB_NAME, else run.dir's folder name
    group: str | None = None  # null: $WANDB_RUN_GROUP, else none
    tags: tuple[str, ...] = ()  # (): $WANDB_TAGS (comma-separated), else none
    # null: $WANDB_MODE, else online (needs `wandb login` or $WANDB_API_KEY); offline: files
    # only (no network), uploaded later with `wandb sync`; disabled: no W&B at all
    mode: str | None = None  # WANDB_MODES

    def __post_init__(self):
        for f, variable in (("project", "WANDB_PROJECT"), ("entity", "WANDB_ENTITY"), ("name", "WANDB_NAME"),
                            ("group", "WANDB_RUN_GROUP")):
            value = getattr(self, f)
            require(value is None or bool(value.strip()), f, value, f"a non-empty name, or null for ${variable}")
        require(all(t.strip() for t in self.tags), "tags", self.tags, "a list of non-empty tags")
        require(self.mode is None or self.mode in WANDB_MODES, "mode", self.mode,
                f"one of {', '.join(WANDB_MODES)}, or null for $WANDB_MODE")


def import_wandb():
    """The wandb module; ImportError naming the extra when it is not installed."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(f"run.loggers lists 'wandb', which needs the wandb package ({err}): "
                          "pip install 'car_jax[wandb]'") from None
    return wandb


def samples_markdown(samples: Sequence[Sample]) -> str:
    """The samples as a markdown table (TensorBoard's text tab renders it): text cells HTML-
    escaped (a response's <answer> tags show as written), `|` escaped, newlines as <br>."""
    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(str(value), quote=False).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in dataclasses.astuple(s)) + " |" for s in samples]
    return "\n".join(lines)


class TensorBoardSink:
    """Scalars and the samples' text in run_dir/tb (tensorboardX)."""

    def __init__(self, run_dir: Path):
        self._writer = SummaryWriter(logdir=str(run_dir / "tb"))

    def log(self, step: int, values: Mapping[str, int | float], samples: Sequence[Sample]) -> None:
        for key, value in values.items():
            if math.isfinite(value):  # an undefined value (AUROC of a one-class batch) stays in the JSONL
                self._writer.add_scalar(key, value, global_step=step)
        if samples:
            self._writer.add_text("samples", samples_markdown(samples), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run: `config` once at the start, then one `run.log` per step (metrics and the
    samples' table under "samples"). `cfg` and the WANDB_* variables pick the project, entity,
    name, group, tags and mode (the module docstring)."""

    def __init__(self, run_dir: Path, cfg: WandbConfig, config: Mapping[str, Any] | None = None):
        self._wandb = wandb = import_wandb()
        folder = os.environ.get("WANDB_DIR") or str(run_dir)
        os.makedirs(folder, exist_ok=True)
        try:
            self._run = wandb.init(
                project=cfg.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                entity=cfg.entity, name=cfg.name or os.environ.get("WANDB_NAME") or Path(run_dir).resolve().name,
                group=cfg.group, tags=list(cfg.tags) or None, mode=cfg.mode, dir=folder, job_type="train",
                config=dict(config or {}))
        except wandb.errors.UsageError as err:  # no API key for an online run, say
            raise RuntimeError(f"W&B could not start a run: {err} Log in (`wandb login` or $WANDB_API_KEY), or "
                               f"log locally with run.wandb.mode=offline and upload later with `wandb sync`") from err

    def log(self, step: int, values: Mapping[str, int | float], samples: Sequence[Sample]) -> None:
        row: dict[str, Any] = dict(values)
        if samples:
            row["samples"] = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                               data=[list(dataclasses.astuple(s)) for s in samples])
        self._run.log(row, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def open_sinks(names: Sequence[str], run_dir: Path, wandb: WandbConfig | None = None,
               config: Mapping[str, Any] | None = None) -> list:
    """One sink per name of `names` (LOGGERS), in order; `wandb` and `config` are the W&B run's
    settings and the config it records. If one fails to open, those already open are closed."""
    for name in names:
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}; the loggers are: {', '.join(LOGGERS)}")
    sinks: list = []
    try:
        for name in names:
            if name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir))
            else:
                sinks.append(WandbSink(run_dir, wandb or WandbConfig(), config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
