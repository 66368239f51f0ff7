"""The experiment's configuration (`car-jax experiment --config X.yaml key=value ...`): which
rewards ("arms") are compared, over which seeds, from which shared warm start, evaluated on
which splits. The training settings every run shares are a whole `TrainConfig` (section
`train`); an arm only sets the reward. Loaded with `car_jax.config.load_config` like the
train and eval configs, so a bad key fails before anything runs; `load_experiment` adds the
one rule for folders saved by an older car_jax (LEGACY).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Sequence

from car_jax.calibration.rewards import RewardConfig
from car_jax.config import load_config, parse_yaml, require
from car_jax.eval.config import EvalDataConfig
from car_jax.eval.runner import EVAL_EPISODE
from car_jax.rollout.episode import EpisodeConfig
from car_jax.train.config import TrainConfig

DEFAULT_ARMS = {"vanilla": RewardConfig(kind="binary"), "rlcr": RewardConfig(kind="brier"),
                "car": RewardConfig(kind="mscr")}
SAVED = "experiment.yaml"  # the config an experiment folder keeps (<dir>/experiment.yaml)
# Keys a folder's saved config lacks when it was written before they existed, and the value
# that gives the saved config its old meaning (today's default may differ): before per-seed
# data order, every run shuffled with train.data.shuffle_seed.
LEGACY = {"data_order": "shared"}


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """The one SFT warm start every run starts from: search demonstrations built from the
    training questions (`car_jax.train.sft.world_demos`), whose stated confidence carries no
    information about correctness unless `confidence="informative"`."""
    steps: int = 32
    batch: int = 4
    lr: float = 1e-4
    # "random": uniform draws in 0..100 (varied, uninformative); an integer: every demonstration says it
    # (then every reward is affine in correctness within a group and the arms coincide); "informative"
    confidence: int | str = "random"
    limit: int | None = None  # demonstrations from the first N training questions (null: all)

    def __post_init__(self):
        require(self.steps >= 1, "steps", self.steps, ">= 1")
        require(self.batch >= 1, "batch", self.batch, ">= 1")
        require(self.lr > 0, "lr", self.lr, "> 0")
        ok = self.confidence in ("random", "informative") or (
            isinstance(self.confidence, int) and 0 <= self.confidence <= 100)
        require(ok, "confidence", self.confidence, "an integer in [0, 100], 'random' or 'informative'")
        require(self.limit is None or self.limit >= 1, "limit", self.limit, ">= 1, or null")


@dataclasses.dataclass(frozen=True)
class ExperimentEvalConfig:
    """Where every final policy (and the warm start) is evaluated: split label -> data."""
    splits: dict[str, EvalDataConfig] = dataclasses.field(default_factory=lambda: {
        "id": EvalDataConfig(path="world", split="dev")})
    batch_size: int = 16
    n_boot: int = 1000  # bootstrap resamples (a single run's interval; the paired question bootstrap)
    episode: EpisodeConfig = EVAL_EPISODE  # greedy
    # the metrics each arm is compared on with the baseline (every one joins the report's Holm
    # family): a name of stats.QUESTION_METRICS, or any numeric key of the evaluations' summary.json
    compare: tuple[str, ...] = ("accuracy", "ece", "auroc")
    power_delta: float = 0.05  # the report's power analysis: seeds for this ECE difference

    def __post_init__(self):
        require(len(self.splits) >= 1, "splits", self.splits, "at least one split")
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        require(self.n_boot >= 100, "n_boot", self.n_boot, ">= 100")
        require({"accuracy", "ece"} <= set(self.compare) and len(set(self.compare)) == len(self.compare),
                "compare", self.compare, "distinct metric names including accuracy and ece (the verdict reads them)")
        require(self.power_delta > 0, "power_delta", self.power_delta, "> 0")


@dataclasses.dataclass(frozen=True)
class EquivalenceConfig:
    """The check that MSCR with b1 = b2 = b trains exactly like (1 + b) x weighted Brier with
    w = b / (1 + b) (and the format penalty divided by 1 + b): GRPO's group-normalized
    advantages do not see the factor. Two runs of `steps` steps from the warm start, same seed."""
    steps: int = 2  # 0: skip the check
    b: float = 1.0

    def __post_init__(self):
        require(self.steps >= 0, "steps", self.steps, ">= 0 (0: no check)")
        require(self.b > 0, "b", self.b, "> 0")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    dir: str = "runs/experiment"
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: dict[str, RewardConfig] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ARMS))
    baseline: str = "vanilla"  # the arm the others are compared with
    # "per_seed": run seed s trains on the data order of shuffle seed train.data.shuffle_seed + s
    # (every arm of a seed sees the same prompts: paired; seeds differ). "shared": every run
    # uses train.data.shuffle_seed (the experiments before per-seed order; LEGACY)
    data_order: Literal["per_seed", "shared"] = "per_seed"
    train: TrainConfig = TrainConfig()  # shared settings; model.path is the base model, reward is the arm's
    warm_start: WarmStartConfig = WarmStartConfig()
    eval: ExperimentEvalConfig = ExperimentEvalConfig()
    equivalence: EquivalenceConfig = EquivalenceConfig()

    def __post_init__(self):
        require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds), "seeds", self.seeds,
                "one or more distinct seeds")
        require(len(self.arms) >= 1, "arms", self.arms, "at least one arm (name: reward section)")
        require(self.baseline in self.arms, "baseline", self.baseline, f"one of the arms {sorted(self.arms)}")
        bad = [a for a in self.arms if not a.replace("_", "").replace("-", "").isalnum()]
        require(not bad, "arms", bad, "names of letters, digits, '-' and '_' (they name run folders)")
        require(self.data_order == "shared" or min(self.seeds) >= 0, "seeds", self.seeds,
                "seeds >= 0 with data_order per_seed (each is a shuffle seed)")

    def shuffle_seed(self, seed: int) -> int:
        """The data order (train.data.shuffle_seed) of run seed `seed`."""
        base = self.train.data.shuffle_seed
        return base + seed if self.data_order == "per_seed" else base


def is_saved_config(path: str | Path, cfg: ExperimentConfig) -> bool:
    """Whether `path` is the config cfg's folder keeps (<cfg.dir>/experiment.yaml)."""
    return Path(path).resolve() == (Path(cfg.dir) / SAVED).resolve()


def load_experiment(path: str | Path | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """`load_config(ExperimentConfig, path, overrides)`, except that a folder's saved config
    (`is_saved_config`) that lacks a LEGACY key reads it with its old value: the folder keeps
    what its runs did. An override still wins (and a folder then refuses the changed config)."""
    cfg = load_config(ExperimentConfig, path, overrides)
    if path is None or not is_saved_config(path, cfg):
        return cfg
    raw = parse_yaml(Path(path).read_text(encoding="utf-8")) or {}
    old = [f"{k}={v}" for k, v in LEGACY.items() if k not in raw]
    return load_config(ExperimentConfig, path, [*old, *overrides]) if old else cfg
