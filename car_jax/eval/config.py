"""The evaluation configuration (`car-jax eval [--config X.yaml] key=value ...`): one small
frozen dataclass per concern, composed by `EvalConfig`, read with `car_jax.config.load_config`
like the training config. The episode settings are `EpisodeConfig` (the same dataclass as
training's `rollout` section, greedy by default here), the tools are `ToolsConfig`
(training's `tools`) and the devices are `sharding.MeshConfig` (training's `mesh`; one device by
default, `mesh.devices=0` for all of them, which a run on several processes needs).

    car-jax eval model.path=runs/car/hf data.path=world data.split=dev mode=search
    car-jax eval model.path=Qwen/Qwen2.5-3B-Instruct ...   # a hub id, fetched into the HF cache
    car-jax eval data.path=simpleqa_verified.csv tools.retriever=http://127.0.0.1:8000/retrieve
    car-jax eval mesh.devices=0 ...   # every device (of every process: jax.distributed)
    car-jax eval samples=4 ...        # also 4 sampled episodes per question (T = 1, top_p 0.95)

Every run with a model also reports the expected confidence at each greedy episode's tag
(`car_jax.rl.confidence`; see `car_jax.eval.runner`); `samples=k` adds k sampled episodes
per question, at temperature 1 and top_p `sample_top_p`, seeded by `seed`.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from car_jax.config import require
from car_jax.data.examples import split_of
from car_jax.eval.runner import EVAL_EPISODE, SAMPLE_TOP_P
from car_jax.models.config import DTYPES
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.toolbox import ToolsConfig
from car_jax.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class EvalModelConfig:
    """The model to evaluate."""
    # HF folder, .gguf file or car_jax params folder; "" = the embedded SmolLM2-135M-Instruct;
    # "builtin:tiny-random" = the positive control's 2-layer random model; a hub id, e.g.
    # model.path=Qwen/Qwen2.5-3B-Instruct (or ...@REVISION: branch, tag, commit), is downloaded once
    # into the HF cache (HF_HUB_OFFLINE=1: cache only); a local path wins (`checkpoints.hub`)
    path: str = ""
    tokenizer: str = ""  # tokenizer folder, .gguf or hub id; "" = model.path
    dtype: str = "float32"  # compute dtype (float32, bfloat16)

    def __post_init__(self):
        require(self.dtype in DTYPES, "dtype", self.dtype, f"a dtype name: one of {', '.join(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class EvalDataConfig:
    path: str = "world"  # "world" (built-in), a .parquet / .jsonl / .json / .csv file, a folder with split, or tfds:NAME[/CONFIG][:SPLIT]
    split: str | None = None  # world: dev (default) or train; a folder: the file stem
    limit: int | None = None  # the first N examples only

    def __post_init__(self):
        require(bool(self.path), "path", self.path, "'world', a data file or a folder")
        require(self.limit is None or self.limit >= 1, "limit", self.limit, ">= 1, or null for every example")
        split_of(self.path, self.split, "split")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str = ""  # output folder; "" = runs/eval-<mode>-<data>[-<split>]
    resume: bool = False  # skip the examples already in <dir>/samples.jsonl
    n_boot: int = 1000  # bootstrap resamples for the 95% intervals (0: none)

    def __post_init__(self):
        require(self.n_boot >= 0, "n_boot", self.n_boot, ">= 0 (0: no intervals)")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    seed: int = 0  # 0 .. 2^31 - 1 (the loader's int32 range; a PRNG key holds its low 32 bits)
    mode: Literal["search", "direct", "tir", "mixed", "qwen"] = "search"  # `eval.runner.MODES`
    batch_size: int = 8  # episodes run together
    model: EvalModelConfig = EvalModelConfig()
    data: EvalDataConfig = EvalDataConfig()
    tools: ToolsConfig = ToolsConfig(code_timeout_s=10.0)
    episode: EpisodeConfig = EVAL_EPISODE
    output: OutputConfig = OutputConfig()
    # the devices the episodes run on: 1 = one device, no mesh (the default); 0 = all of
    # them, rows of a batch split over mesh.fsdp (a short batch is padded with copies of its
    # last example). A run on several processes needs a mesh over all of them: mesh.devices=0
    mesh: MeshConfig = MeshConfig(devices=1)
    # sampled episodes per question beside the greedy one (0: none), at temperature 1
    # (`runner.SAMPLE_TEMPERATURE`) and this top_p (Search-R1's rollout setting), top_k off
    samples: int = 0
    sample_top_p: float = SAMPLE_TOP_P

    def __post_init__(self):
        require(self.seed >= 0, "seed", self.seed, ">= 0")
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        require(self.samples >= 0, "samples", self.samples, ">= 0 (sampled episodes per question; 0: none)")
        require(0 < self.sample_top_p <= 1, "sample_top_p", self.sample_top_p, "in (0, 1]")
