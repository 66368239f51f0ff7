"""Does the paper config fit a v5p-8? The planner's figures next to XLA's own accounting.

configs/qwen2.5-3b_car_mscr.yaml (Qwen2.5-3B-Instruct, bf16 compute, float32 params and
AdamW moments, remat, micro-batches of 64 rows, responses padded to the planner's width)
on a mesh of v5p-8's shape: 4 chips, fsdp=4, tp=1. The planner (`car_jax.plan.make_plan`)
counts per device without weights; `car_jax.plan.xla.xla_memory` lowers the real jitted
train step and the rollout's decode loop (and, with --programs, its prefill) from
`jax.ShapeDtypeStruct`s carrying their shardings on a fake CPU mesh of 4 devices and reads
`compiled.memory_analysis()` (nothing is allocated or run). The rollout rows are the
config's (`rollout.max_concurrent`), or --rollout-rows.

What each XLA phase holds is the program's peak (arguments + outputs - aliased + temporaries)
plus what stays on the device outside it: the train step's arguments are the train state
and the batch, so the frozen reference params are added; the decode loop's are the params
and the KV cache, so the AdamW moments and the reference are added. Caveat: XLA:CPU keeps
float32 copies of some bf16 activations that a TPU would keep in bf16, so a bf16 compile on
CPU overstates a TPU's temporaries.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/plan_qwen3b_v5p8.py [--programs train_step,decode]
        [--rollout-rows 512] [--chip v5p] [--config configs/qwen2.5-3b_car_mscr.yaml] [key=value ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

FSDP, TP = 4, 1
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={FSDP * TP}")

from car_jax.config import load_config  # noqa: E402
from car_jax.plan import make_plan, max_rollout_rows, model_config  # noqa: E402
from car_jax.plan.plan import FIT_FRACTION  # noqa: E402
from car_jax.plan.xla import fake_mesh, xla_memory  # noqa: E402
from car_jax.train.config import TrainConfig  # noqa: E402

GIB = 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/qwen2.5-3b_car_mscr.yaml")
    ap.add_argument("--chip", default="v5p")
    ap.add_argument("--programs", default="train_step,decode", help="of train_step, prefill, decode")
    ap.add_argument("--rollout-rows", type=int, default=None, help="default: the config's rows in flight")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dtype=float32")
    args = ap.parse_args(argv)
    rows = [f"rollout.max_concurrent={args.rollout_rows}"] if args.rollout_rows else []
    cfg = load_config(TrainConfig, args.config, [*rows, *args.overrides])
    model = model_config(cfg.model.path)
    plan = make_plan(cfg, FSDP, TP, args.chip, model=model)
    most = max_rollout_rows(cfg, plan, model)
    sh = plan.shapes
    print(f"{args.config} on {FSDP} x {args.chip} (fsdp={FSDP}, tp={TP}): micro-batch {sh.micro_rows} rows x "
          f"{sh.prompt}+{sh.response} tokens, {sh.rollout_rows} rollout rows x {sh.capacity} slots; "
          f"planner: at most {most} rollout rows fit", flush=True)
    timings = {}
    out = {}
    for name in args.programs.split(","):
        start = time.perf_counter()
        out.update(xla_memory(cfg, model, fake_mesh(FSDP, TP), sh, programs=(name,)))
        timings[name] = time.perf_counter() - start
        print(f"compiled {name} in {timings[name]:.0f} s: {out[name]}", flush=True)
    print(table(plan, out, timings))
    return 0


def table(plan, out, timings) -> str:
    """The markdown table: planner vs XLA per device, per phase, against the chip's HBM."""
    hbm = plan.hbm_bytes
    rows = [("params", plan.params_bytes, None), ("gradients (sum + one micro-batch)", plan.grads_bytes, None),
            ("AdamW moments", plan.opt_state_bytes, None), ("reference params", plan.ref_bytes, None),
            ("weights gathered over fsdp (train: + gradients)", plan.gathered_bytes, None),
            ("KV cache", plan.kv_cache_bytes, None),
            (f"narrowed KV copy of the engine's tail ({plan.shapes.narrow_rows} rows, between programs)",
             plan.narrowing_bytes, None),
            ("rollout temporaries", plan.rollout_temp_bytes, None),
            ("activations (remat)", plan.activation_bytes, None), ("batch arrays", plan.batch_bytes, None)]
    if "train_step" in out:
        c = out["train_step"]
        step = plan.params_bytes + plan.opt_state_bytes + plan.grads_bytes + 2 * plan.gathered_bytes \
            + plan.activation_bytes + plan.batch_bytes
        rows += [("train step program (args + out - aliased + temp)", step, c.peak),
                 ("  of which temporaries", plan.grads_bytes + 2 * plan.gathered_bytes + plan.activation_bytes,
                  c.temp),
                 ("**train phase** (+ reference, held outside)", plan.train_bytes, c.peak + plan.ref_bytes)]
    for name in ("decode", "prefill"):
        if name in out:
            c = out[name]
            program = plan.params_bytes + plan.gathered_bytes + plan.kv_cache_bytes + plan.rollout_temp_bytes
            rows += [(f"{name} program (args + out - aliased + temp)", program, c.peak),
                     (f"rollout phase, {name} (+ moments and reference, held outside)", program + plan.opt_state_bytes
                      + plan.ref_bytes, c.peak + plan.opt_state_bytes + plan.ref_bytes)]
    if any(name in out for name in ("decode", "prefill")):
        rows.append(("**rollout phase** (the larger of a program and the tail's narrowed copy)", plan.rollout_bytes,
                     None))
    lines = ["| per device | planner (GiB) | XLA:CPU (GiB) | XLA / planner |", "|---|---:|---:|---:|"]
    for name, planned, xla in rows:
        ratio = "" if xla is None or not planned else f"{xla / planned:.2f}"
        lines.append(f"| {name} | {planned / GIB:,.2f} | {'' if xla is None else f'{xla / GIB:,.2f}'} | {ratio} |")
    lines.append(f"| HBM of {plan.chip} (fits: under {FIT_FRACTION:.0%}) | {hbm / GIB:,.2f} | | |")
    phases = [out["train_step"].peak + plan.ref_bytes] if "train_step" in out else []
    phases += [out[n].peak + plan.opt_state_bytes + plan.ref_bytes for n in ("decode", "prefill") if n in out]
    peak_xla = max(phases)
    lines.append("")
    lines.append(f"Planner peak {plan.total_bytes / GIB:.2f} GiB ({plan.total_bytes / hbm:.0%} of HBM): "
                 f"{'fits' if plan.fits else 'does NOT fit'}. XLA:CPU peak of the compiled phases "
                 f"{peak_xla / GIB:.2f} GiB ({peak_xla / hbm:.0%} of HBM): "
                 f"{'fits' if peak_xla <= FIT_FRACTION * hbm else 'does NOT fit'}. Compile times: "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
