"""Section train_step: the GRPO train step's time, MFU and compile time, remat off and on.

The decode section's model shape (Qwen2.5-3B's at full size), random weights, bf16
compute over fp32 params (the recipe's setting; AdamW moments follow the params). The batch
is what the trainer builds, through the same public functions (`host_batch`, `to_device`,
`micro_plan`, `micro_batches`): U prompts of P tokens, G responses of R tokens each (every
token valid and in the loss), random old log-probs and advantages, KL on (reference
log-probs 0), in micro-batches of `micro` rows. `rl.steps.make_train_step` builds the step,
as the trainer does. The first call compiles (`compile_s` = its time - the steady step);
then `steps` calls are timed (the median is `step_s`). MFU: `train.flops`'s count of the
step (3 x the forward over the prompt-sharing batch: `update_counts`) / step_s / the chip's
peak (`perf_metrics`; NaN off the chip table).

Checks: loss and gradient norm finite (the norm positive); remat changes no number beyond
rounding: the first step's loss and gradient norm with remat on within REMAT_TOL
(relative) of remat off, from the same initial weights and batch.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from .common import Options, Part, block, check, random_model, timed
from .decode import QWEN25_3B, TINY as DECODE_TINY

REMAT_TOL = 2e-2  # bf16 compute: the recomputed forward may round at other places


@dataclasses.dataclass(frozen=True)
class Shape:
    model: dict  # ModelConfig fields
    prompts: int  # U distinct prompts
    group: int  # G responses a prompt
    micro: int  # rows a micro-batch
    prompt_len: int  # P
    response_len: int  # R
    steps: int  # timed steps after the compile


TINY = Shape(DECODE_TINY.model, prompts=2, group=2, micro=2, prompt_len=8, response_len=12, steps=1)
FULL = Shape(QWEN25_3B, prompts=2, group=4, micro=4, prompt_len=256, response_len=512, steps=3)


def host_rows(shape: Shape, vocab: int):
    """The HostBatch of U x G random trajectories (every token valid and sampled)."""
    from car_jax.rl.host_batch import host_batch
    from car_jax.rollout.episode import Trajectory
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, shape.prompt_len) for _ in range(shape.prompts)]
    trajs = [Trajectory(p, rng.integers(1, vocab, shape.response_len), rng.normal(-4.0, 0.3, shape.response_len),
                        np.ones(shape.response_len, bool)) for p in prompts for _ in range(shape.group)]
    return host_batch(trajs, 0, groups=[i // shape.group for i in range(len(trajs))])


def one_setting(cfg, shape: Shape, remat: bool) -> dict:
    import jax.numpy as jnp

    from car_jax.models.policy import device_kind
    from car_jax.rl import grpo
    from car_jax.rl.batches import micro_batches, to_device
    from car_jax.rl.host_batch import micro_plan
    from car_jax.rl.steps import OptimConfig, init_state, make_optimizer, make_train_step
    from car_jax.train import flops

    model = random_model(cfg, dtype="bfloat16", param_dtype="float32", remat=remat)
    opt = make_optimizer(OptimConfig(lr=1e-6, total_steps=100))
    state = init_state(model.params, opt)
    del model.params
    step = make_train_step(model.module, opt, grpo.LossConfig(kl_coef=0.001), temperature=1.0)
    host = host_rows(shape, cfg.vocab_size)
    rows = host.rows
    device = to_device(host)
    rng = np.random.default_rng(1)
    device = device.replace(advantages=jnp.asarray(rng.normal(size=rows), jnp.float32))
    batch = block(micro_batches(device, micro_plan(host.prompt_of, np.arange(rows), shape.micro)))
    first_s, (state, metrics) = timed(lambda: step(state, batch))
    first = {k: float(v) for k, v in metrics.items()}
    times = []
    for _ in range(shape.steps):
        seconds, (state, _) = timed(lambda: step(state, batch))
        times.append(seconds)
    step_s = statistics.median(times)
    model_flops = 3 * flops.forward_flops(cfg, *flops.update_counts(host.prompts_valid, host.prompt_of, host.valid))
    perf = flops.perf_metrics(model_flops, step_s, 1, device_kind())
    return {"remat": remat, "rows": rows, "micro_batches": rows // shape.micro, "tokens": int(host.valid.sum()),
            "compile_s": first_s - step_s, "first_step_s": first_s, "step_s": step_s, "steps_s": times,
            "model_tflop": model_flops / 1e12, "model_tflops_per_s": perf["perf/model_tflops_per_device"],
            "mfu": perf["perf/mfu"], "loss": first["loss"], "grad_norm": first["grad_norm"]}


def run(opts: Options, part: Part) -> dict:
    from car_jax.models.config import ModelConfig
    shape = TINY if opts.tiny else FULL
    cfg = ModelConfig(**shape.model)
    out = {"model": shape.model, "prompt_len": shape.prompt_len, "response_len": shape.response_len,
           "dtype": "bfloat16 compute, float32 params", "settings": {}, "checks": {}}
    for remat in (False, True):
        r = one_setting(cfg, shape, remat)
        name = f"remat_{'on' if remat else 'off'}"
        out["settings"][name] = r
        part(name, r)
        out["checks"][f"{name}/finite"] = check(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                                                and r["grad_norm"] > 0, [r["loss"], r["grad_norm"]])
    off, on = out["settings"]["remat_off"], out["settings"]["remat_on"]
    for k in ("loss", "grad_norm"):
        diff = abs(on[k] - off[k])
        limit = REMAT_TOL * max(1.0, abs(off[k]))
        out["checks"][f"remat_equal/{k}"] = check(diff <= limit, diff, limit)
    return out


def summary(r: dict) -> str:
    def mfu(x):
        return "n/a" if x != x else f"{x:.1%}"
    return "; ".join(f"{name.replace('_', ' ')}: step {x['step_s']:.3f} s ({x['tokens']} tokens), "
                     f"{x['model_tflops_per_s']:.1f} TFLOP/s, MFU {mfu(x['mfu'])}, compile {x['compile_s']:.1f} s"
                     for name, x in r["settings"].items())
