"""`car-jax train --config configs/X.yaml [key=value ...]`; with `--check`, only load and
check the config (keys, types, ranges, a built-in dataset's split: nothing that depends on
this machine's files or devices), print one line and exit 0 (2 with the error's one line):
`tpu_scripts/launch.sh` runs it locally before it reaches a VM."""
from __future__ import annotations

from car_jax.cli import add_config_args, load_config_args


def register(sub) -> None:
    p = sub.add_parser("train", help="train a CAR / GRPO policy")
    p.add_argument("--check", action="store_true",
                   help="only check the config and its overrides (one line; exit 0, or 2 with the error)")
    add_config_args(p, "see configs/", "rl.loss.kl_coef=0.0 reward.kind=brier")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from car_jax.train.config import TrainConfig

    cfg = load_config_args(TrainConfig, args)
    if args.check:
        print(f"car-jax train: config ok ({args.config or 'defaults'}, {len(args.overrides)} override(s)): "
              f"model {cfg.model.path or 'embedded SmolLM2'}, data {cfg.data.train}:{cfg.data.train_split}, "
              f"{cfg.rl.steps} GRPO steps -> {cfg.run.dir}")
        return 0
    from car_jax.train.trainer import train

    rows = train(cfg)
    if rows:
        last = rows[-1]
        print(f"step {last['step']}: reward {last['reward']:.3f} accuracy {last['accuracy']:.3f} "
              f"ece {last['ece']:.3f} -> {cfg.run.dir}")
    return 0
