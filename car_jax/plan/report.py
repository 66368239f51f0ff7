"""The human table of a `Plan` (`car-jax plan` without --json)."""
from __future__ import annotations

from car_jax.plan.plan import FIT_FRACTION, Plan

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_table(plan: Plan, max_rows: int | None = None) -> str:
    """Per-device bytes of each part, both phases, the chip's HBM and the verdict."""
    sh = plan.shapes
    rows = [
        ("params", plan.params_bytes), ("gradients", plan.grads_bytes), ("optimizer state", plan.opt_state_bytes),
        ("reference params", plan.ref_bytes),
        ("weights gathered over fsdp", plan.gathered_bytes),
        ("  held by the train step (with their gradients)", plan.train_gathered_bytes),
        (f"KV cache ({sh.rollout_rows} rows x {sh.capacity} slots)", plan.kv_cache_bytes),
        (f"  + the tail's narrowed copy ({sh.narrow_rows} rows, a moment)", plan.narrowing_bytes),
        ("rollout temporaries", plan.rollout_temp_bytes),
        (f"activations ({sh.micro_rows // sh.fsdp} rows x {sh.prompt}+{sh.response} tokens, as configured)",
         plan.activation_bytes),
        ("  with remat", plan.activation_remat_bytes), ("  without remat", plan.activation_no_remat_bytes),
        ("batch arrays", plan.batch_bytes),
        ("rollout phase", plan.rollout_bytes), ("train phase", plan.train_bytes),
        ("peak (the larger phase)", plan.total_bytes), (f"HBM of {plan.chip}", plan.hbm_bytes),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{plan.model} on {plan.fsdp * plan.tp} x {plan.chip} (fsdp={plan.fsdp}, tp={plan.tp}), per device:"]
    lines += [f"  {name:<{width}}  {gib(value)}" for name, value in rows]
    lines.append(f"  {'model FLOPs per step':<{width}}  {plan.flops_per_step:12.3e}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"verdict: {verdict} ({plan.total_bytes / plan.hbm_bytes:.0%} of HBM; the limit is "
                 f"{FIT_FRACTION:.0%})")
    if max_rows is not None:
        lines.append(f"rollout rows that fit with the rest of this plan: {max_rows}")
    return "\n".join(lines)
