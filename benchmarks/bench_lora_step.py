"""One GRPO update step with LoRA adapters against full fine-tuning, on the embedded
SmolLM2-135M-Instruct (CPU), in one run on the same machine: the same batch, loss and
optimizer through `rl.steps.make_train_step`, once with the whole model as the train state
and once with rank-r adapters on every projection over the frozen base.

    .venv/bin/python benchmarks/bench_lora_step.py [--rows 32] [--prompt 48] [--response 128] [--rank 16] [--pairs 4]

The batch is `--rows` trajectories (4 per prompt) of random tokens: a `--prompt`-token prompt
and a `--response`-token response each, in 4 micro-batches, KL on (the reference log-probs
come with the batch), fp32 (or `--dtype bfloat16` compute over fp32 storage). Each side's
first call compiles and is left out; then the two alternate, `--pairs` times, so both sides
of a pair see the same state of a shared machine, and the ratio reported is the median over
the pairs. The bytes are what each side holds across steps: the trained params, the AdamW
moments, and for LoRA the frozen base it reads (full fine-tuning's reference copy, and
LoRA's reference, the base itself, are not counted).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header  # noqa: E402

MIB = 2**20


def nbytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def make_batch(vocab: int, args):
    """A device batch [4, rows / 4, ...] of random trajectories with random advantages and
    reference log-probs."""
    import jax.numpy as jnp
    import numpy as np

    from car_jax.rl.batches import micro_batches, to_device
    from car_jax.rl.host_batch import host_batch, micro_plan
    from car_jax.rollout.episode import Trajectory

    rng = np.random.default_rng(0)
    group = 4
    prompts = [list(rng.integers(1, vocab, args.prompt)) for _ in range(args.rows // group)]
    trajs = [Trajectory([int(x) for x in prompts[i // group]], [int(x) for x in rng.integers(1, vocab, args.response)],
                        list(rng.normal(-4, 0.5, args.response)), [1] * args.response) for i in range(args.rows)]
    host = host_batch(trajs, 0)
    batch = to_device(host)
    batch = batch.replace(advantages=jnp.asarray(rng.normal(size=args.rows), jnp.float32),
                          ref_logp=jnp.asarray(np.where(host.valid, rng.normal(-4, 0.5, host.valid.shape), 0),
                                               jnp.float32))
    return micro_batches(batch, micro_plan(host.prompt_of, np.arange(args.rows), args.rows // 4, True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32, help="trajectories of the step (4 per prompt, 4 micro-batches)")
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (storage fp32)")
    args = ap.parse_args()
    if args.rows % 16:
        ap.error(f"--rows {args.rows}: a multiple of 16 (4 micro-batches of whole groups of 4)")

    import jax
    import jax.numpy as jnp

    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir
    from car_jax.models import lora
    from car_jax.models.config import LoraConfig
    from car_jax.rl import grpo
    from car_jax.rl.steps import OptimConfig, init_state, make_optimizer, make_train_step, with_frozen

    model = car_jax.load_model(default_model_dir(), dtype=args.dtype, param_dtype="float32", progress=False)
    opt = make_optimizer(OptimConfig(lr=1e-5, total_steps=100))
    loss = grpo.LossConfig(kl_coef=0.001)
    batch = make_batch(model.config.vocab_size, args)

    cfg = dataclasses.replace(model.config, lora=LoraConfig(rank=args.rank, alpha=args.alpha))
    module = model.module.clone(cfg=cfg)
    base = model.params
    sides = {
        "full": {"state": init_state(jax.tree.map(jnp.copy, base), opt), "frozen": None, "module": model.module},
        "lora": {"state": init_state(lora.init_adapters(cfg, jax.random.key(0)), opt), "frozen": base,
                 "module": module},
    }
    for side in sides.values():
        side["held"] = nbytes(side["state"].params) + nbytes(side["state"].opt_state) + nbytes(side["frozen"])
        side["trained"] = nbytes(side["state"].params)
        side["moments"] = nbytes(side["state"].opt_state)
        side["step"] = with_frozen(make_train_step(side["module"], opt, loss, temperature=1.0), side["frozen"])
        side["times"] = []

    def run(side) -> float:
        start = time.perf_counter()
        side["state"], metrics = side["step"](side["state"], batch)
        jax.block_until_ready((side["state"].params, metrics))
        return time.perf_counter() - start

    compile_s = {name: run(side) for name, side in sides.items()}  # the first call of each compiles
    for _ in range(args.pairs):
        for side in sides.values():
            side["times"].append(run(side))

    full, low = sides["full"], sides["lora"]
    ratios = [a / b for a, b in zip(low["times"], full["times"])]
    print(header(f"GRPO update step, LoRA rank {args.rank} (every projection) vs full fine-tuning, SmolLM2-135M, "
                 f"{args.dtype} compute", f"python benchmarks/bench_lora_step.py --rows {args.rows} --prompt "
                 f"{args.prompt} --response {args.response} --rank {args.rank} --pairs {args.pairs} "
                 f"--dtype {args.dtype}"))
    print(f"{args.rows} trajectories of {args.prompt} + {args.response} tokens in 4 micro-batches, KL on; first calls "
          f"(compile): full {compile_s['full']:.1f} s, LoRA {compile_s['lora']:.1f} s\n")
    print("| pair | full fine-tuning step (s) | LoRA step (s) | LoRA / full |")
    print("|---:|---:|---:|---:|")
    for i, (a, b, r) in enumerate(zip(full["times"], low["times"], ratios), 1):
        print(f"| {i} | {a:.2f} | {b:.2f} | {r:.3f} |")
    print(f"\nLoRA time / full time, median over {len(ratios)} pairs: **{statistics.median(ratios):.3f}** "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})\n")
    print("| | trained params (MiB) | AdamW moments (MiB) | held across steps: params + moments "
          "(+ frozen base) (MiB) |")
    print("|---|---:|---:|---:|")
    for name, side in (("full fine-tuning", full), (f"LoRA rank {args.rank}", low)):
        print(f"| {name} | {side['trained'] / MIB:.1f} | {side['moments'] / MIB:.1f} | {side['held'] / MIB:.1f} |")
    print(f"\nAdamW moments, full / LoRA: {full['moments'] / low['moments']:.0f}x")


if __name__ == "__main__":
    main()
