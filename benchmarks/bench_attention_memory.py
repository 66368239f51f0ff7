"""Compiled temp memory of training attention (forward + backward): dense vs blockwise.

For each sequence length T, `jax.value_and_grad` of sum(attention(q, k, v) * cotangent)
w.r.t. q, k and v is lowered from abstract inputs (`jax.ShapeDtypeStruct`: nothing is
allocated or run) and compiled; XLA's `memory_analysis().temp_size_in_bytes` is the
scratch memory the program needs beyond its arguments and outputs. Dense attention
(`flash.dense_attention` over the decoder's causal slot mask) holds float32 scores
[B, N, T, T]: quadratic in T. Blockwise attention (`flash.blockwise_attention`) holds one
block's scores and per-row state: linear in T. The head layout is Qwen2.5-3B's: 16 query
heads, 2 kv heads, head dim 128; one row, every token valid.

A second table does the same for the GRPO train forward (`prompt_response_hidden`: a
prompt of P tokens run once, 2 responses of 512 tokens after it; gradient w.r.t. all
params) of a small random 2-layer decoder, under the plain policy with dense attention and
with blockwise attention: the layer's masks are built there as dense [T, S] booleans, and
this shows that blockwise attention, which reads only their last rows, leaves XLA nothing
[T, S] to hold.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_attention_memory.py
        [--lengths 1024,2048,4096,8192] [--dtype bfloat16] [--block 512]
"""
from __future__ import annotations

import argparse
import sys

import dataclasses

import jax
import jax.numpy as jnp

from car_jax.models import flash
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN
from car_jax.models.prompt_forward import prompt_response_hidden

N_HEADS, KV_HEADS, HEAD_DIM, ROWS = 16, 2, 128, 1
SMALL = ModelConfig("qwen2", vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                    mlp_dim=256)
RESPONSES, RESPONSE_LEN = 2, 512


def temp_bytes(attend, t: int, dtype) -> int:
    """Compiled temp bytes of value_and_grad of sum(attend(q, k, v, valid) * ct) at length t."""
    g = N_HEADS // KV_HEADS
    q = jax.ShapeDtypeStruct((ROWS, t, KV_HEADS, g, HEAD_DIM), dtype)
    kv = jax.ShapeDtypeStruct((ROWS, t, KV_HEADS, HEAD_DIM), dtype)
    valid = jax.ShapeDtypeStruct((ROWS, t), jnp.bool_)

    def loss(q, k, v, valid, ct):
        return jnp.sum(attend(q, k, v, valid).astype(jnp.float32) * ct.astype(jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn.lower(q, kv, kv, valid, q).compile().memory_analysis().temp_size_in_bytes


def model_temp_bytes(attention, p_len: int, dtype) -> int:
    """Compiled temp bytes of the gradient of the train forward's hidden states (summed)
    w.r.t. the params of `SMALL`, one prompt of p_len tokens, RESPONSES rows after it."""
    module = Decoder(SMALL, dtype=dtype, policy=dataclasses.replace(PLAIN, attention=attention))
    params = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    index = jnp.zeros((RESPONSES,), jnp.int32)

    def loss(params, prompt, prompt_valid, tokens, valid):
        last, hidden = prompt_response_hidden(module, params, prompt, prompt_valid, tokens, valid, index)
        return hidden.astype(jnp.float32).sum() + last.astype(jnp.float32).sum()

    spec = jax.ShapeDtypeStruct
    prompt, response = (1, p_len), (RESPONSES, RESPONSE_LEN)
    lowered = jax.jit(jax.grad(loss)).lower(params, spec(prompt, jnp.int32), spec(prompt, bool),
                                            spec(response, jnp.int32), spec(response, bool))
    return lowered.compile().memory_analysis().temp_size_in_bytes


def table(rows, measure, mib: int = 1 << 20) -> None:
    """Prints one markdown row per length: (dense, blockwise) bytes from measure(t), growth."""
    print("| T | dense temp (MiB) | x prev | blockwise temp (MiB) | x prev | dense / blockwise |")
    print("|---:|---:|---:|---:|---:|---:|")
    prev = None
    for t in rows:
        d, b = measure(t)
        grow = ("", "") if prev is None else (f"{d / prev[0]:.2f}", f"{b / prev[1]:.2f}")
        print(f"| {t} | {d / mib:,.1f} | {grow[0]} | {b / mib:,.1f} | {grow[1]} | {d / b:.1f} |")
        sys.stdout.flush()
        prev = (d, b)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block", type=int, default=512, help="block_q = block_k of the blockwise attention")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    def dense(q, k, v, valid):
        return flash.dense_attention(q, k, v, flash.slot_mask(valid, 0, q.shape[1]))

    def blockwise(q, k, v, valid):
        return flash.blockwise_attention(q, k, v, valid, 0, args.block, args.block)

    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"attention forward + backward, {ROWS} row, {N_HEADS} q heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, "
          f"{args.dtype}, blocks {args.block}; jax {jax.__version__} on {jax.default_backend()}\n")
    table(lengths, lambda t: (temp_bytes(dense, t, dtype), temp_bytes(blockwise, t, dtype)))
    print(f"\ntrain forward + backward (prompt_response_hidden), T = prompt length P, {RESPONSES} responses of "
          f"{RESPONSE_LEN} tokens, {SMALL.n_layers} layers, d_model {SMALL.d_model}, {SMALL.n_heads} q heads, "
          f"{SMALL.n_kv_heads} kv heads, {args.dtype}\n")
    blocks = flash.Blockwise(args.block, args.block)
    table(lengths, lambda t: (model_temp_bytes(flash.DENSE, t, dtype), model_temp_bytes(blocks, t, dtype)))

if __name__ == "__main__":
    main()
