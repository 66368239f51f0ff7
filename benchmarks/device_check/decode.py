"""Section decode: sampling throughput of the decode loop, the share of the chip's HBM
bandwidth it reaches, and its compile time, through the public entry points
(`rollout.generate.generate_ids`, `prefill_prompts`), not the loop's own functions.

A model of Qwen2.5-3B's shape (`car_jax/configs/models/Qwen/Qwen2.5-3B-Instruct`, written
out below) with random bf16 weights, initialised on the device (nothing is downloaded).
Per batch size B: B distinct random prompts of P tokens, then N sampled tokens a row
(temperature 1, EOS off, so every row runs N steps). Timed in this order, each call's
arrays computed:

1. `prefill_prompts` twice: its compile, then the prefill alone (`prefill_s`);
2. `generate_ids` twice (prefill + decode loop): the first compiles the loop
   (`decode_compile_s` = first - second; the prefill is compiled already), the second runs it;
   decode_s = second - prefill_s, tokens/s = B x N / decode_s.

Bytes a decode step reads: every weight once (the tied embedding as the unembedding; an
untied model's input embedding is a gather of B rows, not counted) plus the KV cache's
keys and values over the window the step attends (the whole cache under a one-stage
policy, as on accelerators). Its share of the chip's bandwidth: bytes x steps / decode_s /
`train.flops.CHIPS[...].hbm_bytes_per_s` (NaN on a chip not in the table, e.g. a CPU).
Checks: every row sampled N tokens, the loop ran N steps, a positive, finite rate.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .common import IdTokenizer, Options, Part, check, random_model, timed


@dataclasses.dataclass(frozen=True)
class Shape:
    model: dict  # ModelConfig fields
    batches: tuple[int, ...]
    prompt: int  # P
    new: int  # N


QWEN25_3B = dict(model_type="qwen2", vocab_size=151936, d_model=2048, n_layers=36, n_heads=16, n_kv_heads=2,
                 head_dim=128, mlp_dim=11008, rope_theta=1e6, qkv_bias=True, tie_embeddings=True)
TINY = Shape(dict(model_type="qwen2", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  mlp_dim=128, qkv_bias=True, tie_embeddings=True), batches=(1, 8), prompt=16, new=16)
FULL = Shape(QWEN25_3B, batches=(1, 64, 256), prompt=128, new=256)


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads (see the module docstring)."""
    import jax
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    return total if model.config.tie_embeddings else total - model.params["embed"].nbytes


def cache_bytes(cache) -> int:
    """Bytes of the cache's keys and values (every layer, row and slot)."""
    import jax
    return sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))


def one_batch(model, rows: int, shape: Shape, bandwidth: float | None) -> dict:
    from car_jax.rollout.generate import generate_ids, prefill_prompts
    from car_jax.rollout.sampling import Sampler
    rng = np.random.default_rng(rows)
    ids = [rng.integers(1, model.config.vocab_size, shape.prompt).tolist() for _ in range(rows)]
    tok = IdTokenizer(model.config.vocab_size)
    prefill = lambda: prefill_prompts(model, ids, shape.new, 0)[:2]  # noqa: E731 - (logits, cache)
    prefill_first, _ = timed(prefill)
    prefill_s, (_, cache) = timed(prefill)
    kv = cache_bytes(cache)
    del cache
    gen = lambda seed: generate_ids(model, tok, ids, max_new_tokens=shape.new, sampler=Sampler(1.0),  # noqa: E731
                                    seed=seed, eos=np.array([], np.int32))
    first_s, _ = timed(lambda: gen(0))
    total_s, out = timed(lambda: gen(1))
    steps = int(out.steps)
    decode_s = max(total_s - prefill_s, 1e-9)
    step_bytes = weight_bytes(model) + kv
    rate = rows * steps / decode_s
    achieved = step_bytes * steps / decode_s
    result = {"rows": rows, "prompt": shape.prompt, "new": shape.new, "steps": steps,
              "prefill_compile_s": prefill_first - prefill_s, "prefill_s": prefill_s,
              "decode_compile_s": first_s - total_s, "decode_s": decode_s, "generate_s": total_s,
              "tokens_per_s": rate, "step_ms": 1e3 * decode_s / max(steps, 1),
              "bytes_per_step": step_bytes, "kv_bytes": kv, "hbm_gb_per_s": achieved / 1e9,
              "hbm_fraction": achieved / bandwidth if bandwidth else float("nan")}
    lengths = np.asarray(out.length)
    result["checks"] = {
        f"b{rows}/all_rows_sampled": check(bool((lengths == shape.new).all()), int(lengths.min()), shape.new),
        f"b{rows}/steps": check(steps == shape.new, steps, shape.new),
        f"b{rows}/rate": check(math.isfinite(rate) and rate > 0, rate),
    }
    return result


def run(opts: Options, part: Part) -> dict:
    import jax

    from car_jax.models.config import ModelConfig
    from car_jax.models.policy import device_kind
    from car_jax.train import flops
    shape = TINY if opts.tiny else FULL
    cfg = ModelConfig(**shape.model)
    model = random_model(cfg, dtype="bfloat16", param_dtype="bfloat16")
    chip = flops.chip(device_kind())
    out = {"model": shape.model, "params": int(sum(x.size for x in jax.tree.leaves(model.params))),
           "weight_bytes": weight_bytes(model), "policy": model.module.policy.name,
           "decode_stages": model.module.policy.decode_stages, "chip": chip.name if chip else None,
           "chip_hbm_bytes_per_s": chip.hbm_bytes_per_s if chip else None, "batches": {}, "checks": {}}
    for rows in shape.batches:
        r = one_batch(model, rows, shape, chip.hbm_bytes_per_s if chip else None)
        out["checks"].update(r.pop("checks"))
        out["batches"][str(rows)] = r
        part(f"batch_{rows}", r)
    return out


def summary(r: dict) -> str:
    def frac(x):
        return "n/a" if x != x else f"{x:.0%}"
    return f"{r['params']:,} params; " + "; ".join(
        f"B={b}: {x['tokens_per_s']:,.0f} tok/s, {x['step_ms']:.2f} ms a step, {x['hbm_gb_per_s']:,.0f} GB/s "
        f"({frac(x['hbm_fraction'])} of HBM peak), loop compile {x['decode_compile_s']:.1f} s"
        for b, x in r["batches"].items())
