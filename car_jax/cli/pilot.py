"""`car-jax pilot [--config X.yaml] [--checkpoint PATH] [--math500 PATH] [key=value ...]`:
the confidence-dichotomy study. Direct prompting, prompt-based tool use and (with
--checkpoint) an RL-trained policy, for the evidence tool (search, world-large QA) and the
verification tool (code, world-large arithmetic or MATH-500); per cell accuracy, ECE, MCIP
and AUROC with bootstrap intervals, Welch t-tests between the settings, a table, pilot.json
and pilot.png. With `kinds=[...,mixed]` also one policy with both tools (world-large mixed_dev:
search questions and word problems, each part reported apart). The keys are
`car_jax.eval.pilot.PilotConfig`'s:

    car-jax pilot evidence_data.limit=100 verification_data.limit=100
    car-jax pilot --checkpoint runs/car/hf --math500 math500.jsonl out=runs/pilot-car
    car-jax pilot kinds=[evidence,verification,mixed] mixed_checkpoint=runs/smollm2_mixed_cpu/hf
    car-jax pilot kinds=[evidence] model.path=Qwen2.5-3B-Instruct/ tools.retriever=http://127.0.0.1:8000/retrieve
"""
from __future__ import annotations

from car_jax.cli import add_config_args, load_config_args


def register(sub) -> None:
    p = sub.add_parser("pilot", help="the confidence-dichotomy pilot: direct vs tool use vs RL, evidence vs verification tool "
                                       "(vs both: kinds=[...,mixed])")
    p.add_argument("--checkpoint", default=None, help="RL-trained policy for the rl setting (same as checkpoint=PATH)")
    p.add_argument("--math500", default=None, metavar="PATH",
                   help="MATH-500 file for the verification tool (same as verification_data.path=PATH)")
    add_config_args(p, "keys of car_jax.eval.pilot.PilotConfig", "evidence_data.limit=50 episode.max_turns=2 out=runs/pilot")
    p.set_defaults(func=pilot_command)


def pilot_command(args) -> int:
    from car_jax.eval.job import EvalSetupError
    from car_jax.eval.pilot import PILOT_FILE, PILOT_PLOT, PilotConfig, format_pilot, run_pilot

    args.overrides = overrides(args)
    cfg = load_config_args(PilotConfig, args)
    try:
        result = run_pilot(cfg)
    except (EvalSetupError, FileNotFoundError) as err:
        raise SystemExit(f"car-jax pilot: {err}") from None
    print(format_pilot(result))
    print(f"wrote {cfg.out}/{PILOT_FILE}, {cfg.out}/{PILOT_PLOT} and the cells' eval folders under {cfg.out}/")
    return 0


def overrides(args) -> list[str]:
    """--checkpoint and --math500 as the config keys they stand for, before the given overrides."""
    out = [f"checkpoint={args.checkpoint}"] if args.checkpoint is not None else []
    if args.math500 is not None:
        out += [f"verification_data.path={args.math500}", "verification_data.split=null"]
    return out + list(args.overrides)
