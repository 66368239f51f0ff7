"""The matmuls of one decode step at batch 32 (SmolLM2-135M shapes), XLA against torch
on this machine's CPU, same inputs, same run: how close the rollout is to what a matmul
library gives for rows this few.

    .venv/bin/python benchmarks/bench_decode_matmuls.py [--rows 32] [--layers 30]

Each shape runs over `--layers` distinct weight matrices per call, as a decode step
reads 30 layers' weights (so they stream from memory, not from cache). fp32. Needs
torch (the `test` extra)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, timed  # noqa: E402

# (name, in features, out features) of SmolLM2-135M's per-layer products
SHAPES = [("q / o projection", 576, 576), ("k or v projection", 576, 192), ("gate or up", 576, 1536),
          ("down", 1536, 576)]


def best_of(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls after one warm-up call (compiles, first touch)."""
    fn()
    return timed(fn, repeats)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    print(header(f"Decode-step matmuls, {args.rows} rows x {args.layers} layers, fp32",
                 f"python benchmarks/bench_decode_matmuls.py --rows {args.rows} --layers {args.layers}"))
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__}\n")
    print("| product | [rows, in] @ [in, out] | XLA (ms) | XLA GFLOP/s | torch (ms) | torch GFLOP/s | XLA / torch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, k, n in SHAPES:
        ws = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(args.layers)]
        x = rng.standard_normal((args.rows, k), dtype=np.float32)
        jx, jws = jnp.asarray(x), [jnp.asarray(w) for w in ws]
        products = jax.jit(lambda x, ws: [x @ w for w in ws])
        t_jax = best_of(lambda: jax.block_until_ready(products(jx, jws)), args.repeats) / args.layers
        tx, tws = torch.from_numpy(x), [torch.from_numpy(w) for w in ws]

        def torch_products():
            with torch.no_grad():
                return [tx @ w for w in tws]

        t_torch = best_of(torch_products, args.repeats) / args.layers
        flops = 2 * args.rows * k * n
        print(f"| {name} | [{args.rows}, {k}] @ [{k}, {n}] | {t_jax * 1e3:.3f} | {flops / t_jax / 1e9:.0f} | "
              f"{t_torch * 1e3:.3f} | {flops / t_torch / 1e9:.0f} | {t_jax / t_torch:.2f} |")


if __name__ == "__main__":
    main()
