"""One evaluation from its config: load the model, the data and the mode's tools, run
`runner.evaluate`, close the tools. `car-jax eval` and `car-jax run` both call `run_eval`.
With several processes (`jax.distributed`) every process calls it with the same config;
process 0 logs and writes the files."""
from __future__ import annotations

import re
from pathlib import Path

import car_jax
from car_jax import hosts
from car_jax.checkpoints.hub import is_hub_id, resolve_model_path
from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.checkpoints.sources import check_model_path
from car_jax.data import DatasetError, load_dataset
from car_jax.eval.config import EvalConfig, EvalDataConfig, EvalModelConfig
from car_jax.eval.runner import SAMPLES_FILE, EvalOptions, evaluate, get_mode
from car_jax.models.config import UnsupportedConfigError
from car_jax.rollout.toolbox import open_tools


class EvalSetupError(ValueError):
    """The configured model, tokenizer or data cannot be used (message names the key)."""


def load_eval_model(cfg: EvalModelConfig, mesh=None):
    """(model, tokenizer, model path) for `cfg` ("" path: the embedded SmolLM2; a hub id is
    fetched into the HF cache, `checkpoints.hub`), on `mesh` (`MeshConfig.build()`; None: one
    device) with the sampling sharding table (weights split over tp only, so a decode step
    gathers no weights). The model path returned is the local file or folder."""
    try:
        model_path = resolve_model_path(cfg.path)
    except CheckpointError as err:
        raise EvalSetupError(f"model.path={err}") from None
    try:
        check_model_path(model_path)  # a folder without a model is said so, not blamed on its tokenizer
    except CheckpointError as err:
        raise EvalSetupError(f"model.path: {err}") from None
    try:
        tok_path = resolve_model_path(cfg.tokenizer) if cfg.tokenizer else model_path
    except CheckpointError as err:
        raise EvalSetupError(f"model.tokenizer={err}") from None
    try:
        tokenizer = car_jax.load_tokenizer(tok_path)
    except (OSError, ValueError) as err:
        raise EvalSetupError(f"cannot load a tokenizer from {tok_path} ({err}); set model.tokenizer "
                             "(an HF folder or .gguf holding one)") from None
    try:
        model = car_jax.load_model(model_path, dtype=cfg.dtype, mesh=mesh, mode="sample", progress=hosts.is_writer())
    except (CheckpointError, UnsupportedConfigError) as err:
        raise EvalSetupError(f"model.path: {err}") from None
    return model, tokenizer, model_path


def data_label(cfg: EvalDataConfig) -> tuple[str, str | None]:
    """(dataset name, split) as the summary and the default output folder name them."""
    if cfg.path.startswith("tfds:"):  # tfds:NAME[/CONFIG][:VERSION][:SPLIT] -> folder-safe NAME-CONFIG, SPLIT
        safe = lambda x: re.sub(r"[^A-Za-z0-9._-]+", "-", x).strip("-")  # noqa: E731
        name, _, rest = cfg.path[len("tfds:"):].partition(":")
        rest = re.sub(r"^\d+\.\d+\.\d+:?", "", rest)  # drop a version
        return safe(name), cfg.split or (safe(rest) or None)
    name = cfg.path if cfg.path == "world" else Path(cfg.path).stem
    return name, cfg.split or ("dev" if cfg.path == "world" else None)


def output_dir(cfg: EvalConfig) -> Path:
    """output.dir, or runs/eval-<mode>-<data>[-<split>]."""
    if cfg.output.dir:
        return Path(cfg.output.dir)
    name, split = data_label(cfg.data)
    return Path(f"runs/eval-{cfg.mode}-{name}{'-' + split if split else ''}")


def eval_options(cfg: EvalConfig, progress: bool = True) -> EvalOptions:
    """How `runner.evaluate` runs, from the config's keys (resume and n_boot: `output.*`)."""
    return EvalOptions(mode=cfg.mode, episode=cfg.episode, batch_size=cfg.batch_size, resume=cfg.output.resume,
                       n_boot=cfg.output.n_boot, seed=cfg.seed, samples=cfg.samples, sample_top_p=cfg.sample_top_p,
                       progress=progress)


def _quiet(_line: str) -> None:
    """The log of processes other than 0."""


def run_eval(cfg: EvalConfig, *, label: str | None = None, progress: bool = True, log=print) -> dict:
    """Evaluates per `cfg`; returns the summary (also in <output dir>/summary.json).
    `label` names the model in the summary (default: its path). A bad `mesh` fails first
    (ConfigError), before any data or model loads; a missing data file, an output folder that
    already holds samples (without output.resume) and a path that holds no model are an
    EvalSetupError before the model loads."""
    mesh = cfg.mesh.build()
    log = log if hosts.is_writer() else _quiet
    try:
        examples = load_dataset(cfg.data.path, split=cfg.data.split, limit=cfg.data.limit)
    except (FileNotFoundError, DatasetError) as err:
        raise EvalSetupError(f"data.path: {err}") from None
    name, split = data_label(cfg.data)
    data = name + (f":{split}" if split else "")
    out = output_dir(cfg)
    samples = out / SAMPLES_FILE
    if not cfg.output.resume and samples.is_file() and samples.stat().st_size:
        raise EvalSetupError(f"output.dir: {samples} already holds samples; pass output.resume=true to continue "
                             f"that run, or choose another output.dir")
    model, tokenizer, model_path = load_eval_model(cfg.model, mesh)
    if is_hub_id(cfg.model.path):  # the summary names the hub id, not the snapshot folder it resolved to
        model_path = cfg.model.path
    with open_tools(get_mode(cfg.mode).tool, cfg.tools) as box:
        log(f"eval: {len(examples)} examples of {data}, mode {cfg.mode}, model {model_path}, tool {box.label}, "
            f"out {out}")
        return evaluate(model, tokenizer, examples, eval_options(cfg, progress), tools=box.tools, out_dir=out,
                        info={"model": label or str(model_path), "data": data, "tool": box.label})
