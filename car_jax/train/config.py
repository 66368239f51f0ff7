"""The training configuration: one small frozen dataclass per concern, composed at the top.

Load with `car_jax.config.load_config(TrainConfig, "configs/X.yaml", ["rl.loss.kl_coef=0"])`;
every field below is a YAML key (nested by section). The episode settings (`rollout`) are
`rollout.episode.EpisodeConfig`'s, the ones `car-jax eval` reads too, and the tools
(`tools`) are `rollout.toolbox.ToolsConfig`, shared with eval as well.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from car_jax.calibration.rewards import RewardConfig
from car_jax.rl.grpo import LossConfig
from car_jax.rl.steps import OptimConfig
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.toolbox import ToolsConfig


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy to train: where it is loaded from and how it runs."""
    path: str = ""  # HF folder, .gguf, car_jax params folder; "" = the embedded SmolLM2-135M-Instruct
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of the policy (optimizer moments follow it)
    remat: bool = False  # recompute each layer in the backward pass


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    fsdp: int = -1  # -1: the devices left after tp
    tp: int = 1
    devices: int = 0  # use the first N devices; 0 = all. With one device there is no mesh.


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = "world"  # a dataset path or built-in name (car_jax.data.load_dataset)
    train_split: str | None = "train"
    template: str = "search"  # car_jax.data.prompts.TEMPLATES
    limit: int | None = None  # use only the first N examples
    shuffle_seed: int = 0


@dataclasses.dataclass(frozen=True)
class RolloutConfig(EpisodeConfig):
    """The episode settings (every EpisodeConfig field: turns, token budgets, tool timeout,
    temperature, top_p, top_k) plus what only training rollouts have: the GRPO group
    size and the action protocol. `run_episodes` takes it as its EpisodeConfig."""
    group_size: int = 5  # G trajectories per prompt
    protocol: Literal["car_search", "search_r1", "tir"] = "car_search"

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 100
    prompts_per_step: int = 512
    mini_batch: int = 0  # trajectories per optimizer update; 0 = the whole step's batch
    micro_batch: int = 0  # trajectories per gradient micro-batch; 0 = the mini-batch
    epochs: int = 1  # passes over each rollout batch
    adv_std_norm: bool = True  # False: Dr.GRPO advantages (no std division)
    recompute_old_logp: bool = False  # True: old log-probs from a forward pass instead of the sampler's
    loss: LossConfig = LossConfig()  # its log-prob temperature is the rollout's, not a key here
    optim: OptimConfig = OptimConfig(lr=1e-6, warmup_steps=0, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    data: str | None = None  # JSONL of {"messages": [...], "response": "..."} or {"prompt", "response"}
    steps: int = 0
    batch: int = 8
    lr: float = 1e-5


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/car"
    checkpoint_every: int = 50
    keep: int = 3
    tensorboard: bool = True
    resume: bool = True  # continue from the latest checkpoint in dir
    export_hf: bool = True  # write the final policy as an HF folder (dir/hf)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    model: PolicyConfig = PolicyConfig()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    tools: ToolsConfig = ToolsConfig()
    reward: RewardConfig = RewardConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()
    run: RunConfig = RunConfig()
