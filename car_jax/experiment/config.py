"""The experiment's configuration (`car-jax experiment --config X.yaml key=value ...`): which
rewards ("arms") are compared, over which seeds, from which shared warm start, evaluated on
which splits. The training settings every run shares are a whole `TrainConfig` (section
`train`); an arm only sets the reward. Loaded with `car_jax.config.load_config` like the
train and eval configs, so a bad key fails before anything runs.
"""
from __future__ import annotations

import dataclasses

from car_jax.calibration.rewards import RewardConfig
from car_jax.config import require
from car_jax.eval.config import EvalDataConfig
from car_jax.eval.runner import EVAL_EPISODE
from car_jax.rollout.episode import EpisodeConfig
from car_jax.train.config import TrainConfig

DEFAULT_ARMS = {"vanilla": RewardConfig(kind="binary"), "rlcr": RewardConfig(kind="brier"),
                "car": RewardConfig(kind="mscr")}


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
    n_boot: int = 1000  # bootstrap resamples of the report's intervals
    episode: EpisodeConfig = EVAL_EPISODE  # greedy

    def __post_init__(self):
        require(len(self.splits) >= 1, "splits", self.splits, "at least one split")
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        require(self.n_boot >= 100, "n_boot", self.n_boot, ">= 100")


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
