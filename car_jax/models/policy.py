"""The execution policy: how the model runs on a backend, chosen once per model.

An `ExecutionPolicy` is a frozen, hashable set of variants (small objects and plain
functions): how the layers iterate and the KV cache is laid out, how backward passes
transpose matmul operands, how sums over the vocabulary, the tied unembedding, greedy
picks and sampling draws are computed, the cache dtype, and the default number of decode
stages, and which attention runs over a long chunk of tokens (`models.flash`). It is a
static field of `Decoder`, so it is part of every jit cache key, and model code calls it
(`module.policy.layers.cached(...)`, `module.policy.draw(...)`) rather than testing the
backend.

`PLAIN` is the accelerator path, plain JAX: layers scanned over stacked weights in
training, prefill and decode with one stacked cache (`models.stacked`), `.T`, `sum`,
`einsum`, `argmax`, `jax.random.categorical`, the cache in the compute dtype, one decode
stage, and blockwise (flash) attention for chunks of at least `LONG_SCORES` scores per
head (`ACCELERATOR_ATTENTION`: long prompts and responses; never a decode step), the
dense one below. `XLA_CPU` swaps in the XLA:CPU layouts and kernels of `models.xla_cpu`,
each the same numbers as its plain counterpart, and runs dense attention up to a larger
size (`CPU_ATTENTION`). The attention variant reaches the layers of the prompt-sharing
train forward (`models.prompt_forward`, what the train steps and log-prob passes run)
and of `Decoder.__call__` (full forward, prefill; decode steps stay dense).
`Decoder(cfg)` built without a policy gets
`PLAIN`; `loading.load_model` asks `backend_policy()`, the one place in car_jax that tests
which backend runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from car_jax.models import flash, xla_cpu
from car_jax.models.cache import KVCache
from car_jax.models.config import ModelConfig
from car_jax.models.stacked import SCANNED


def plain_row_sum(x: jax.Array) -> jax.Array:
    """x [X, V] -> [X], the sum over V."""
    return x.sum(axis=-1)


def plain_tied_unembed(x: jax.Array, embed: jax.Array, dtype) -> jax.Array:
    """hidden x [..., D] against the tied embedding [V, D] -> float32 logits [..., V]."""
    return jnp.einsum("...D,VD->...V", x, embed.astype(dtype), preferred_element_type=jnp.float32)


def plain_argmax(x: jax.Array) -> jax.Array:
    """int32[B]: the first index of the maximum of x [B, V]."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def categorical(scaled: jax.Array, key: jax.Array) -> jax.Array:
    """int32[B]: one draw per row of softmax(scaled) [B, V] (Gumbel-max)."""
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def compute_dtype_cache(compute_dtype) -> jnp.dtype:
    """The cache holds keys and values in the compute dtype."""
    return jnp.dtype(compute_dtype)


# Attention over a chunk of T tokens and S keys. The dense one holds float32 scores
# [B, N, T, S] (and keeps the probabilities for the backward pass); from T = S = 1024 on
# (4 MiB per head and row) the accelerator policy runs the blockwise one, whose memory is
# linear in T. The threshold is a memory choice, not a measured crossover: no accelerator
# has timed the two yet.
LONG_SCORES = 1024 * 1024
ACCELERATOR_ATTENTION = flash.Blockwise(block_q=512, block_k=512, min_scores=LONG_SCORES)
# XLA:CPU, timed on 2 cores (BENCHMARKS.md, "Training attention memory"): the train forward
# and backward of a SmolLM2-wide model after a 1024-token prompt took about as long either
# way, after a 2048-token prompt 1.2-1.4x less with blockwise attention. The CPU tests and
# the demo run shorter sequences, so they keep the dense path.
CPU_ATTENTION = flash.Blockwise(block_q=512, block_k=512, min_scores=2048 * 2048)
# The hooks for the platforms' own kernels, each a variant with `handles` / `__call__`:
# - GPU: `flash.Fused("cudnn")`, jax.nn.dot_product_attention on cuDNN's flash kernel,
#   wired but never run on a GPU, so no backend gets it by default: a GPU policy is
#   `dataclasses.replace(PLAIN, attention=CUDNN_ATTENTION)`. The model's masks reach it as
#   a [B, 1, T, S] bias (see `flash.Fused`), not its linear-memory length masks.
# - TPU: the Pallas splash kernel (jax.experimental.pallas.ops.tpu.splash_attention) would
#   be a variant taking `key_ok` (the mask's last row, as `flash.Blockwise` does) as kv
#   segment ids (queries all in segment 1) and a causal mask at the chunk's offset: valid
#   queries then see what they see here (a padded query loses its own slot: its output,
#   which no valid token reads, differs). Not written: no TPU here.
CUDNN_ATTENTION = flash.Fused(implementation="cudnn", min_scores=LONG_SCORES)


@dataclasses.dataclass(frozen=True)
class ExecutionPolicy:
    name: str = "plain"
    layers: Any = SCANNED  # layer iteration and cache layout: stacked.Scanned or xla_cpu.Unrolled
    transpose: Callable = jnp.transpose  # a [n, m] -> [m, n], an operand of the hand-written backward matmuls
    row_sum: Callable = plain_row_sum  # x [X, V] -> [X] (the log-prob head's softmax sums)
    tied_unembed: Callable = plain_tied_unembed  # (x [..., D], embed [V, D], dtype) -> float32[..., V]
    argmax: Callable = plain_argmax  # logits [B, V] -> int32[B] (greedy)
    draw: Callable = categorical  # (scaled logits [B, V], key) -> int32[B] (sampling)
    cache_dtype: Callable = compute_dtype_cache  # compute dtype -> KV-cache dtype
    decode_stages: int = 1  # decode stages of a segment by default (`generate.decode_windows`)
    attention: Any = ACCELERATOR_ATTENTION  # a `models.flash` variant, for chunks it `handles(T, S)`

    def init_cache(self, cfg: ModelConfig, batch_size: int, capacity: int, compute_dtype,
                   mesh: Mesh | None = None) -> KVCache:
        """An empty cache in this policy's layout and dtype (on `mesh`: split as the
        sampling table says)."""
        return self.layers.init_cache(cfg, batch_size, capacity, self.cache_dtype(compute_dtype), mesh)

    def train_params(self, params, dtype):
        """params as a jitted train step for compute dtype `dtype` should read them; take
        gradients w.r.t. these and bring them back to the stored layout with `stored_grads`."""
        return self.layers.train_params(params, dtype)

    def stored_grads(self, grads):
        """Gradients w.r.t. `train_params` in the layout of the stored params (XLA_CPU's
        split layers restacked; stacked ones as they are)."""
        return self.layers.stored_grads(grads)

    def loop_params(self, params, dtype):
        """params as the decode loop reads them, computed once outside its `while_loop`."""
        return self.layers.loop_params(params, dtype)


PLAIN = ExecutionPolicy()

XLA_CPU = ExecutionPolicy(
    name="xla_cpu",
    layers=xla_cpu.UNROLLED,
    transpose=xla_cpu.transposed,
    row_sum=xla_cpu.dot_row_sum,
    tied_unembed=xla_cpu.tied_unembed,
    argmax=xla_cpu.first_argmax,
    draw=xla_cpu.inverse_cdf,
    cache_dtype=xla_cpu.float32_cache,
    decode_stages=4,  # each stage reads fewer cache slots; each is one more loop to compile
    attention=CPU_ATTENTION,
)


def backend_policy(backend: str | None = None) -> ExecutionPolicy:
    """The policy for `backend` (default: the backend jax runs on): XLA_CPU on "cpu",
    PLAIN on every other."""
    backend = jax.default_backend() if backend is None else backend
    return XLA_CPU if backend == "cpu" else PLAIN


def device_kind() -> str:
    """What chip jax runs on: the first device's `device_kind` ("TPU v5 lite", "NVIDIA
    H100 80GB HBM3", "cpu"), for the chip table of `train.flops` (MFU)."""
    return jax.devices()[0].device_kind
