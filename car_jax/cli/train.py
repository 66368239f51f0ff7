"""`car-jax train --config configs/X.yaml [key=value ...]`."""
from __future__ import annotations

from car_jax.cli import add_config_args, load_config_args


def register(sub) -> None:
    p = sub.add_parser("train", help="train a CAR / GRPO policy")
    add_config_args(p, "see configs/", "rl.loss.kl_coef=0.0 reward.kind=brier")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from car_jax.train.config import TrainConfig
    from car_jax.train.trainer import train

    cfg = load_config_args(TrainConfig, args)
    rows = train(cfg)
    if rows:
        last = rows[-1]
        print(f"step {last['step']}: reward {last['reward']:.3f} accuracy {last['accuracy']:.3f} "
              f"ece {last['ece']:.3f} -> {cfg.run.dir}")
    return 0
