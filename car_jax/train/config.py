"""The training configuration: one small frozen dataclass per concern, composed at the top.

Load with `car_jax.config.load_config(TrainConfig, "configs/X.yaml", ["rl.loss.kl_coef=0"])`;
every field below is a YAML key (nested by section). The episode settings (`rollout`) are
`rollout.episode.EpisodeConfig`'s, the ones `car-jax eval` reads too, and the tools
(`tools`) are `rollout.toolbox.ToolsConfig`, shared with eval as well. Each section checks
its ranges when it is built, and `TrainConfig` the batch layout across sections, so a bad
value fails at load time (`ConfigError` naming the dotted key), before any model loads.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from car_jax.calibration.rewards import RewardConfig
from car_jax.config import require
from car_jax.data.examples import split_of
from car_jax.data.prompts import TEMPLATES
from car_jax.models.config import DTYPES, LoraConfig
from car_jax.rl.dynamic import DynamicSamplingConfig
from car_jax.rl.grpo import LossConfig
from car_jax.rl.steps import OptimConfig
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.toolbox import ToolsConfig
from car_jax.sharding import MeshConfig
from car_jax.train.loggers import LOGGERS, WandbConfig

MAX_GROUP = 1_000  # trajectories per prompt
MAX_PROMPTS = 1_000_000  # prompts per step (x MAX_GROUP trajectories still fit int32)
DEFAULT_LOGGERS = ("tensorboard",)  # run.loggers's default


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy to train: where it is loaded from and how it runs."""
    # HF folder, .gguf, car_jax params folder; "" = the embedded SmolLM2-135M-Instruct;
    # "builtin:tiny-random" = a 2-layer random-init model with its tokenizer (the positive control's);
    # a hub id, e.g. model.path=Qwen/Qwen2.5-3B-Instruct (or ...@REVISION: branch, tag, commit), is
    # downloaded once into the HF cache (HF_HUB_OFFLINE=1: cache only); a local path wins (`checkpoints.hub`)
    path: str = ""
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of the policy (optimizer moments follow it)
    remat: bool = False  # recompute each layer in the backward pass
    # LoRA: rank > 0 trains low-rank adapters on the `targets` projections (x W + alpha/rank (x A) B)
    # and freezes the base, which is also the KL reference (adapters off); rank 0: full fine-tuning
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        for f in ("dtype", "param_dtype"):
            require(getattr(self, f) in DTYPES, f, getattr(self, f), f"a dtype name: one of {', '.join(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = "world"  # a dataset path or built-in name (car_jax.data.load_dataset)
    train_split: str | None = "train"
    template: str = "search"  # car_jax.data.prompts.TEMPLATES
    limit: int | None = None  # use only the first N examples
    shuffle_seed: int = 0

    def __post_init__(self):
        require(bool(self.train), "train", self.train, "a dataset path or built-in name (e.g. world)")
        require(self.template in TEMPLATES, "template", self.template, f"one of {', '.join(TEMPLATES)}")
        require(self.limit is None or self.limit >= 1, "limit", self.limit, ">= 1, or null for every example")
        split_of(self.train, self.train_split, "train_split")
        require(self.shuffle_seed >= 0, "shuffle_seed", self.shuffle_seed, ">= 0")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(EpisodeConfig):
    """The episode settings (every EpisodeConfig field: turns, token budgets, tool timeout,
    temperature, top_p, top_k) plus what only training rollouts have: the GRPO group
    size and the action protocol. `run_episodes` takes it as its EpisodeConfig."""
    group_size: int = 5  # G trajectories per prompt (at most MAX_GROUP)
    # qwen: Qwen2.5 / Qwen3 Instruct native tool calls (the prompt lists the tools via its chat template)
    protocol: Literal["car_search", "search_r1", "tir", "mixed", "qwen"] = "car_search"  # rollout.protocols.PROTOCOLS

    def __post_init__(self):
        super().__post_init__()
        require(self.group_size >= 2, "group_size", self.group_size,
                ">= 2: GRPO's advantage compares the trajectories of a prompt with each other (a group of one "
                "has no baseline: its advantage would be the raw reward)")
        require(self.group_size <= MAX_GROUP, "group_size", self.group_size,
                f"<= {MAX_GROUP} (trajectories per prompt)")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 100  # 0: the SFT warm start alone (needs sft.steps > 0), exported as run.dir/hf
    prompts_per_step: int = 512  # at most MAX_PROMPTS
    mini_batch: int = 0  # trajectories per optimizer update; 0 = the whole step's batch
    micro_batch: int = 0  # trajectories per gradient micro-batch; 0 = the mini-batch
    epochs: int = 1  # passes over each rollout batch
    adv_std_norm: bool = True  # False: Dr.GRPO advantages (no std division)
    recompute_old_logp: bool = False  # True: old log-probs from a forward pass instead of the sampler's
    loss: LossConfig = LossConfig()  # its log-prob temperature and horizon are the rollout's (make_train_step)
    optim: OptimConfig = OptimConfig(lr=1e-6, warmup_steps=0, grad_clip=1.0)
    # DAPO's dynamic sampling (`rl.dynamic`): drop groups without a signal, sample more prompts
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()

    def __post_init__(self):
        require(self.steps >= 0, "steps", self.steps, ">= 0 (GRPO steps to run; 0: SFT only)")
        require(1 <= self.prompts_per_step <= MAX_PROMPTS, "prompts_per_step", self.prompts_per_step,
                f">= 1 and <= {MAX_PROMPTS}")
        for f in ("mini_batch", "micro_batch"):
            require(getattr(self, f) >= 0, f, getattr(self, f), ">= 0 (0: the whole step's / mini-batch's rows)")
        require(self.epochs >= 1, "epochs", self.epochs, ">= 1")
        if self.loss.tis_cap is not None and not self.recompute_old_logp:
            raise ValueError(f"rl.loss.tis_cap={self.loss.tis_cap} needs rl.recompute_old_logp=true: the TIS weight "
                             f"compares the trainer's old log-probs with the sampler's (or set rl.loss.tis_cap=null)")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    data: str | None = None  # JSONL of {"messages": [...], "response": "..."} or {"prompt", "response"}
    steps: int = 0
    batch: int = 8
    lr: float = 1e-5

    def __post_init__(self):
        require(self.steps >= 0, "steps", self.steps, ">= 0 (0: no SFT warm start)")
        require(self.data is not None or self.steps == 0, "data", self.data,
                f"a JSONL file or 'world' when sft.steps={self.steps} > 0 (or set sft.steps=0)")
        require(self.batch >= 1, "batch", self.batch, ">= 1")
        require(self.lr > 0, "lr", self.lr, "> 0")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where the run writes: checkpoints, metrics and their loggers (`train.log`), the export."""
    dir: str = "runs/car"
    checkpoint_every: int = 50
    keep: int = 3
    # Where the step metrics go besides dir/metrics.jsonl (always written): any of "tensorboard"
    # (event files in dir/tb) and "wandb" (Weights & Biases, settings in run.wandb; needs
    # `pip install 'car_jax[wandb]'`), [] for none. Command line: run.loggers=[tensorboard,wandb].
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    # Deprecated, superseded by run.loggers (kept for the configs and saved runs that set it):
    # false drops "tensorboard" from the default run.loggers; with any other run.loggers it must
    # agree with it (true: "tensorboard" listed, false: not), else it is an error. The loaded
    # config holds null and the resolved run.loggers.
    tensorboard: bool | None = None
    wandb: WandbConfig = WandbConfig()  # the W&B run, when run.loggers lists "wandb"
    samples_per_step: int = 16  # a step's first N trajectories (the writer process's), logged as a table; 0: none
    resume: bool = True  # continue from the latest checkpoint in dir
    export_hf: bool = True  # write the final policy as an HF folder (dir/hf)

    def __post_init__(self):
        require(bool(self.dir), "dir", self.dir, "a folder path")
        require(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, ">= 1 (steps)")
        require(self.keep >= 1, "keep", self.keep, ">= 1 (checkpoints kept)")
        require(self.samples_per_step >= 0, "samples_per_step", self.samples_per_step,
                ">= 0 (trajectories logged per step; 0: none)")
        object.__setattr__(self, "loggers", resolve_loggers(self.loggers, self.tensorboard))
        object.__setattr__(self, "tensorboard", None)


def resolve_loggers(loggers: Sequence[str], tensorboard: bool | None) -> tuple[str, ...]:
    """run.loggers with the deprecated run.tensorboard folded in (see RunConfig); ValueError at
    the key at fault for an unknown or repeated name and for a contradiction. A section given in
    part is merged onto the default RunConfig, so an old `tensorboard: false` arrives with the
    default loggers: that pair means "no TensorBoard" (and is the one pair not checked)."""
    loggers = tuple(loggers)
    for i, name in enumerate(loggers):
        if name not in LOGGERS:
            raise ValueError(f"loggers={name!r} is not a logger; the loggers are: {', '.join(LOGGERS)} "
                             f"(metrics.jsonl is always written)")
        if name in loggers[:i]:
            raise ValueError(f"loggers={list(loggers)} lists {name!r} twice; name each logger once")
    if tensorboard is None or tensorboard == ("tensorboard" in loggers):
        return loggers
    if tensorboard is False and loggers == DEFAULT_LOGGERS:
        return ()
    raise ValueError(f"tensorboard={str(tensorboard).lower()} contradicts run.loggers={list(loggers)}; "
                     f"run.tensorboard is deprecated: drop it and list the loggers in run.loggers alone")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0  # 0 .. 2^31 - 1 (the loader's int32 range; a PRNG key holds its low 32 bits)
    model: PolicyConfig = PolicyConfig()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    tools: ToolsConfig = ToolsConfig()
    reward: RewardConfig = RewardConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        require(self.seed >= 0, "seed", self.seed, ">= 0")
        over, budget = self.reward.overlong, (self.rollout.max_turns + 1) * self.rollout.max_response_tokens
        require(over.buffer <= (over.max_tokens or budget), "reward.overlong.buffer", over.buffer,
                f"<= the length cap L_max ({over.max_tokens or budget}: reward.overlong.max_tokens, or when 0 "
                f"(rollout.max_turns + 1) x rollout.max_response_tokens); the penalty ramps over the last "
                f"buffer tokens before it")
        native = self.rollout.protocol == "qwen"  # native tool calls: the qwen prompt, and only it
        require(native == (self.data.template == "qwen"), "data.template", self.data.template,
                "'qwen' with rollout.protocol=qwen, and 'qwen' only with it (its prompt leaves the tool layout to "
                f"the chat template's native calls; rollout.protocol is {self.rollout.protocol!r})")
        require(self.rl.steps >= 1 or self.sft.steps >= 1, "rl.steps", self.rl.steps,
                ">= 1, or 0 with sft.steps >= 1 for a run that only does the SFT warm start")
        rl, n = self.rl, self.rl.prompts_per_step * self.rollout.group_size
        mini = rl.mini_batch or n
        micro = rl.micro_batch or mini
        require(n % mini == 0, "rl.mini_batch", rl.mini_batch, f"a divisor of the {n} trajectories of a step "
                f"(rl.prompts_per_step={rl.prompts_per_step} x rollout.group_size={self.rollout.group_size}), or 0")
        require(mini % micro == 0, "rl.micro_batch", rl.micro_batch, f"a divisor of the mini-batch ({mini}), or 0")
        if self.mesh.fsdp > 1 and self.mesh.devices != 1:  # the rows of a micro-batch are split over fsdp
            require(micro % self.mesh.fsdp == 0, "rl.micro_batch", rl.micro_batch,
                    f"such that a micro-batch ({micro} rows) is a multiple of mesh.fsdp={self.mesh.fsdp}")
