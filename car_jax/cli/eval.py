"""`car-jax eval [--config X.yaml] [key=value ...]`: a model's accuracy and calibration on a
dataset. The keys are `car_jax.eval.config.EvalConfig`'s (the same YAML + dotted-override
system as `car-jax train`):

    car-jax eval                                      # embedded SmolLM2, world dev split, search
    car-jax eval mode=direct data.limit=20
    car-jax eval model.path=ckpt/ data.path=nq_search/ data.split=test \\
        tools.retriever=http://127.0.0.1:8000/retrieve
    car-jax eval mode=tir data.path=math500.jsonl output.dir=runs/tir
    car-jax eval ... output.resume=true               # continue a run that stopped
    car-jax eval --gate 0.7 data.limit=40             # answer directly; search only when q < 0.7

`--gate TAU` (`car_jax.eval.gate`) evaluates the confidence-gated agent: it answers without
the tool first and runs the tool episode (mode search or tir) only when its confidence is
below TAU; it prints the curve of accuracy, ECE and tool calls per question over TAU.

The logic lives in `car_jax.eval.job` and `car_jax.eval.runner`.
"""
from __future__ import annotations

from car_jax.cli import add_config_args, load_config_args


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy and calibration of a model on a dataset (search / direct / tir)")
    add_config_args(p, "keys of car_jax.eval.config.EvalConfig",
                    "model.path=runs/car/hf mode=direct episode.max_turns=2 output.resume=true")
    p.add_argument("--gate", type=float, default=None, metavar="TAU",
                   help="confidence-gated tool use: answer directly, run the tool only when the "
                        "confidence is below TAU (in [0, 1]); writes gate.json, gate.png and the curve over TAU")
    p.set_defaults(func=eval_command)


def eval_command(args) -> int:
    from car_jax import hosts
    from car_jax.config import ConfigError
    from car_jax.eval.config import EvalConfig
    from car_jax.eval.job import EvalSetupError, output_dir, run_eval
    from car_jax.eval.runner import format_table

    cfg = load_config_args(EvalConfig, args)
    if args.gate is not None:
        return _gate(cfg, args.gate)
    try:
        summary = run_eval(cfg)
    except EvalSetupError as err:
        raise ConfigError(str(err)) from None  # one line, exit 2
    if not hosts.is_writer():  # several processes: process 0 reports (and wrote the files)
        return 0
    print(format_table(summary))
    for w in summary["warnings"]:
        print(f"note: {w}")
    out = output_dir(cfg)
    print(f"wrote {out / 'samples.jsonl'}, {out / 'summary.json'}, {out / 'reliability.png'}")
    return 0


def check_gate(cfg, tau: float) -> None:
    """`--gate TAU`'s checks before anything runs: TAU in [0, 1] and a tool mode (ConfigError)."""
    from car_jax.config import ConfigError
    from car_jax.eval.gate import TOOL_MODES, check_tau

    try:
        check_tau(tau)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.mode not in TOOL_MODES:
        raise ConfigError(f"--gate needs a tool mode: mode=search or mode=tir, not mode={cfg.mode}")


def _gate(cfg, tau: float) -> int:
    from car_jax import hosts
    from car_jax.config import ConfigError
    from car_jax.eval.gate import GATE_FILE, GATE_PLOT, format_curve, run_gate
    from car_jax.eval.job import EvalSetupError
    from car_jax.eval.runner import compare_table

    check_gate(cfg, tau)
    try:
        result = run_gate(cfg, tau)
    except EvalSetupError as err:
        raise ConfigError(str(err)) from None  # one line, exit 2
    if not hosts.is_writer():
        return 0
    s = result["summary"]
    print(f"\n== confidence-gated {result['tool_mode']} (tool when q < TAU), {s['n']} examples ==")
    print(format_curve(result["curve"], tau))
    print()
    print(compare_table({"direct": result["direct"], result["tool_mode"]: result["tool"],
                         f"gate {tau:g}": s}))
    print(f"wrote {result['out']}/{GATE_FILE}, {result['out']}/{GATE_PLOT} and the two runs it combines")
    return 0
