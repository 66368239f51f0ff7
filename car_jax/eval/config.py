"""The evaluation configuration (`car-jax eval [--config X.yaml] key=value ...`): one small
frozen dataclass per concern, composed by `EvalConfig`, read with `car_jax.config.load_config`
like the training config. The episode settings are `EpisodeConfig` (the same dataclass as
training's `rollout` section, greedy by default here) and the tools are `ToolsConfig`
(training's `tools`).

    car-jax eval model.path=runs/car/hf data.path=world data.split=dev mode=search
    car-jax eval data.path=simpleqa_verified.csv tools.retriever=http://127.0.0.1:8000/retrieve
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from car_jax.eval.runner import EVAL_EPISODE
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.toolbox import ToolsConfig


@dataclasses.dataclass(frozen=True)
class EvalModelConfig:
    """The model to evaluate."""
    path: str = ""  # HF folder, .gguf file or car_jax params folder; "" = the embedded SmolLM2-135M-Instruct
    tokenizer: str = ""  # tokenizer folder or .gguf; "" = model.path
    dtype: str = "float32"  # compute dtype (float32, bfloat16)


@dataclasses.dataclass(frozen=True)
class EvalDataConfig:
    path: str = "world"  # "world" (built-in), a .parquet / .jsonl / .csv file, or a folder with split
    split: str | None = None  # world: dev (default) or train; a folder: the file stem
    limit: int | None = None  # the first N examples only


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str = ""  # output folder; "" = runs/eval-<mode>-<data>[-<split>]
    resume: bool = False  # skip the examples already in <dir>/samples.jsonl
    n_boot: int = 1000  # bootstrap resamples for the 95% intervals (0: none)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    seed: int = 0
    mode: Literal["search", "direct", "tir"] = "search"  # `eval.runner.MODES`
    batch_size: int = 8  # episodes run together
    model: EvalModelConfig = EvalModelConfig()
    data: EvalDataConfig = EvalDataConfig()
    tools: ToolsConfig = ToolsConfig(code_timeout_s=10.0)
    episode: EpisodeConfig = EVAL_EPISODE
    output: OutputConfig = OutputConfig()

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
