"""`car-jax train --config configs/X.yaml [key=value ...]`."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("train", help="train a CAR / GRPO policy")
    p.add_argument("--config", default=None, help="YAML config (see configs/); omitted: all defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.loss.kl_coef=0.0 reward.kind=brier")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from car_jax.config import ConfigError, load_config
    from car_jax.train.config import TrainConfig
    from car_jax.train.trainer import train

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        raise SystemExit(f"car-jax train: {err}") from None
    rows = train(cfg)
    if rows:
        last = rows[-1]
        print(f"step {last['step']}: reward {last['reward']:.3f} accuracy {last['accuracy']:.3f} "
              f"ece {last['ece']:.3f} -> {cfg.run.dir}")
    return 0
