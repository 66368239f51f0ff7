"""`car-jax eval [--config X.yaml] [key=value ...]`: a model's accuracy and calibration on a
dataset. The keys are `car_jax.eval.config.EvalConfig`'s (the same YAML + dotted-override
system as `car-jax train`):

    car-jax eval                                      # embedded SmolLM2, world dev split, search
    car-jax eval mode=direct data.limit=20
    car-jax eval model.path=ckpt/ data.path=nq_search/ data.split=test \\
        tools.retriever=http://127.0.0.1:8000/retrieve
    car-jax eval mode=tir data.path=math500.jsonl output.dir=runs/tir
    car-jax eval ... output.resume=true               # continue a run that stopped

The logic lives in `car_jax.eval.job` and `car_jax.eval.runner`.
"""
from __future__ import annotations

from car_jax.cli import add_config_args, load_config_args


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy and calibration of a model on a dataset (search / direct / tir)")
    add_config_args(p, "keys of car_jax.eval.config.EvalConfig",
                    "model.path=runs/car/hf mode=direct episode.max_turns=2 output.resume=true")
    p.set_defaults(func=eval_command)


def eval_command(args) -> int:
    from car_jax import hosts
    from car_jax.eval.config import EvalConfig
    from car_jax.eval.job import EvalSetupError, output_dir, run_eval
    from car_jax.eval.runner import format_table

    cfg = load_config_args(EvalConfig, args)
    try:
        summary = run_eval(cfg)
    except EvalSetupError as err:
        raise SystemExit(f"car-jax eval: {err}") from None
    if not hosts.is_writer():  # several processes: process 0 reports (and wrote the files)
        return 0
    print(format_table(summary))
    for w in summary["warnings"]:
        print(f"note: {w}")
    out = output_dir(cfg)
    print(f"wrote {out / 'samples.jsonl'}, {out / 'summary.json'}, {out / 'reliability.png'}")
    return 0
