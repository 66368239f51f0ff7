"""The GRPO loss and its gradient at the vocabulary projection: `head_loss.grpo_head_loss`
(the loss fused into the projection, what the train step runs) against autodiff of
`grpo.grpo_loss` over `logprobs.chunked_head` (the projection recomputed in the backward
pass), on SmolLM2-135M's head shapes (D 576, V 49152), random inputs, fp32, CPU.

    .venv/bin/python benchmarks/bench_head_loss.py [--rows 8] [--lengths 128 384 1024]

Each length is R response positions of --rows rows, in chunks of 128 positions: the
fused loss runs 3 vocabulary-sized products per chunk, autodiff 4 once there are two or
more chunks (with one chunk XLA merges the forward and the recomputed products)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 384, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from car_jax.models.policy import backend_policy
    from car_jax.rl import grpo
    from car_jax.rl.head_loss import HeadSpec, grpo_head_loss
    from car_jax.rl.logprobs import chunked_head

    d, v, b = 576, 49152, args.rows
    cfg = grpo.LossConfig(kl_coef=0.001)
    policy = backend_policy()  # the kernels the train step runs on this backend
    rows = []
    for n in args.lengths:
        rng = np.random.default_rng(0)
        h = jnp.asarray(rng.normal(size=(b, n, d)) * 0.05, jnp.float32)
        w = jnp.asarray(rng.normal(size=(d, v)) * 0.05, jnp.float32)
        y = jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32)
        old = jnp.asarray(rng.normal(-10.8, 0.1, (b, n)), jnp.float32)
        ref, adv, mask = old + 0.01, jnp.asarray(rng.normal(size=b), jnp.float32), jnp.ones((b, n), jnp.float32)
        norm, targets = grpo.norm_of(mask), grpo.LossTargets(old, ref, adv, mask)

        def autodiff(h, w):
            logp, ent = chunked_head(h, y, w, 1.0, policy=policy)
            return grpo.grpo_loss(logp, ent, targets, cfg, norm)[0]

        def fused(h, w):
            return grpo_head_loss(h, w, y, targets, cfg, norm, HeadSpec(policy=policy))[0]

        times = []
        for fn in (autodiff, fused):
            step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
            jax.block_until_ready(step(h, w))  # compile
            times.append(timed(lambda: jax.block_until_ready(step(h, w)), args.repeats)[0])
        rows.append((n, *times))
    print(header(f"GRPO loss + gradient at the vocabulary projection, {b} rows, D {d}, V {v}, fp32",
                 "python benchmarks/bench_head_loss.py --rows {} --lengths {}".format(
                     b, " ".join(map(str, args.lengths)))))
    print("| response positions | chunks of 128 | autodiff over chunked_head (ms) | fused grpo_head_loss (ms) | fused / autodiff |")
    print("|---:|---:|---:|---:|---:|")
    for n, a, f in rows:
        print(f"| {n} | {-(-n // 128)} | {a * 1e3:.0f} | {f * 1e3:.0f} | {f / a:.2f} |")


if __name__ == "__main__":
    main()
