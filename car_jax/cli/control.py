"""`car-jax control`: the positive control (`car_jax.experiment.control`). A tiny random model
learns, through the real trainer, the confidence each kind of coin deserves: the chance task
grades an answer correct with the kind's probability p, so Brier and MSCR (b1 = b2) should
reach E[q | kind] = p, MSCR with b1 != b2 its own q*, and the binary reward nothing.

    car-jax control                                   # 4 arms x 5 seeds x 1200 steps (run or resume), then report
    car-jax control --arms brier,binary --seeds 0,1   # a subset
    car-jax control --split extremes --steps 60 --out runs/control-x   # p = 0.1, 0.9 only
    car-jax control --quick --out runs/control-quick  # Brier vs binary, p = 0.1, 0.9, seed 0, 60 steps
    car-jax control --report --out results/control    # rebuild the table and figure; run nothing

Every unit is a `car-jax train` folder under --out that resumes where it stopped.
"""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("control", help="the positive control: learn E[q | kind] = q* on the chance task")
    p.add_argument("--out", default="runs/control", help="folder of the units and the report")
    p.add_argument("--arms", type=_names, default=None, help="comma-separated arms (default binary, brier, mscr, "
                   "mscr_b2_3; also brier_std: Brier with GRPO's std normalisation, and mscr_wide: MSCR "
                   "with 2.5x the trajectories per optimizer update, and mscr_b1_2: MSCR with b1 = 2, b2 = 1)")
    p.add_argument("--seeds", type=_seeds, default=None, help="comma-separated seeds (default 0,1,2,3,4)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default: the split's budget, "
                   "1200 for the five kinds, 60 for extremes)")
    p.add_argument("--split", default=None, help="the coins to train on and score: train (all five kinds, the "
                   "default) or extremes (p = 0.1 and 0.9 only)")
    p.add_argument("--quick", action="store_true", help="the quick version (about 9 minutes on two cores): "
                   "defaults to --arms brier,binary --seeds 0 --split extremes --steps 60")
    p.add_argument("--report", action="store_true", help="rebuild the report from --out; run nothing")
    p.add_argument("overrides", nargs="*", help="dotted train-config overrides for every unit, e.g. "
                   "rl.optim.lr=1e-3 (sft.* reaches the warm start only: the arms run no SFT)")
    p.set_defaults(func=_run)


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one arm")
    return names


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 0,1,2") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give seeds >= 0")
    return seeds


def _run(args) -> int:
    from car_jax.config import ConfigError
    from car_jax.experiment import control

    if args.quick:
        args.arms = args.arms or list(control.QUICK_ARMS)
        args.seeds = args.seeds if args.seeds is not None else list(control.QUICK_SEEDS)
        args.split = args.split or control.QUICK_SPLIT
        args.steps = args.steps if args.steps is not None else control.QUICK_STEPS
    args.split = args.split or "train"
    arms = args.arms or list(control.DEFAULT_ARMS)
    unknown = [a for a in arms if a not in control.ARMS]
    if unknown:
        raise ConfigError(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(control.ARMS)}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps: {args.steps} must be >= 1")
    seeds = args.seeds if args.seeds is not None else list(range(5))
    from car_jax.data import chance

    if args.split not in chance.SPLITS:
        raise ConfigError(f"--split: {args.split!r} is not one of {', '.join(chance.SPLITS)}")
    if args.report:
        rep = control.report(args.out, arms=arms, seeds=seeds, kinds=chance.SPLITS[args.split])
    else:
        rep = control.run_control(args.out, arms=arms, seeds=seeds, steps=args.steps,
                                  split=args.split, overrides=args.overrides)
    print(control.format_report(rep))
    for name, arm in rep["arms"].items():
        verdict = {True: "learns q* in every seed", False: "does not reach q* (with every kind answered) in every seed",
                   None: "incomplete"}[arm["learned"]]
        print(f"{name}: {verdict} (tolerance {rep['tolerance']:g})")
    print(f"wrote {args.out}/{control.TABLE_FILE}, {args.out}/{control.REPORT_FILE} and {args.out}/{control.PLOT_FILE}")
    return 0
