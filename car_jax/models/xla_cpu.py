"""Every layout and kernel that exists to make XLA:CPU faster, and nothing else.

The CPU execution policy (`policy.XLA_CPU`) selects these; the plain policy never runs
them. Each is numerically the plain op it replaces (tested against it), laid out or
written the way XLA:CPU runs fastest:

- `Unrolled`: with a KV cache the layers run as a Python loop, each over its own weights
  and its own cache arrays (the cache a tuple of L arrays [B, K, H, S] / [B, K, S, H]):
  a scan over stacks would copy every layer's weights and cache slice out of the stacks
  on each decode step. The decode loop splits the weights per layer and casts them to
  the compute dtype once, outside its `while_loop` (`loop_params`): XLA:CPU copies a
  slice of a stack on every use, and bf16 compute over fp32 storage then streams half the
  bytes. bf16 train steps split the weights once per step and run a Python loop
  (`train_params`): the scan's backward pass stacks bf16 residuals with an update that
  XLA:CPU runs by converting the whole stack at every layer; in float32 the scan is as
  fast and compiles faster, so it stays.
- `transposed`: a real transposed copy of a bf16 operand for the backward matmuls. XLA
  folds a plain `.T` into the dot, and XLA:CPU runs a bf16 dot whose contraction is not
  (lhs 1, rhs 0) by upcasting both operands to float32 first; a copy plus a bf16 dot is
  faster. Through a size-1 axis the transpose is not folded. float32 gets the plain `.T`.
- `tied_unembed`: for a decode step's few rows, E @ x.T over the [V, D] embedding, then
  transposed; XLA:CPU runs x @ E.T slower. The barrier keeps XLA from folding the
  transpose back into the dot.
- `float32_cache`: the cache in float32 whatever the compute dtype: XLA:CPU rewrites a
  bf16 cache write as a copy of the whole layer cache through float32, and runs bf16
  attention products on float32 copies anyway. Stored bf16 values are exact in float32.
- `inverse_cdf`: one uniform number per row instead of Gumbel-max's V random numbers and
  two logs per token; `first_argmax`: two plain reductions instead of a (value, index)
  pair reduction, which XLA:CPU does not vectorise.
- `dot_row_sum`: sums over the vocabulary as a matrix-vector product; XLA:CPU's fused
  exp-and-reduce kernel is slower than an exp pass plus a dot.

Letters: see `car_jax.dims`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from car_jax.models.cache import KVCache, LayerKV, empty_rows, zeros
from car_jax.models.config import ModelConfig


def transposed(a: jax.Array) -> jax.Array:
    """a [n, m] -> a.T [m, n] for a dot to read: a real copy in bf16 (see above)."""
    if a.dtype == jnp.float32:
        return a.T
    return a[None].transpose(2, 0, 1).reshape(a.shape[1], a.shape[0])


def tied_unembed(x: jax.Array, embed: jax.Array, dtype) -> jax.Array:
    """hidden x [..., D] against the tied embedding [V, D] -> float32 logits [..., V]; for
    at most 128 rows as (E @ x.T).T behind a barrier (see above)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows <= 128:
        e = embed.astype(dtype)
        out = jnp.dot(e, x.reshape(rows, -1).astype(dtype).T, preferred_element_type=jnp.float32)  # [V, X]
        return jax.lax.optimization_barrier(out).T.reshape(*x.shape[:-1], -1)
    return jnp.einsum("...D,DV->...V", x, embed.T.astype(dtype), preferred_element_type=jnp.float32)


def float32_cache(compute_dtype) -> jnp.dtype:
    """The cache dtype for any compute dtype: float32 (see above)."""
    return jnp.dtype(jnp.float32)


def dot_row_sum(x: jax.Array) -> jax.Array:
    """x [X, V] -> float32[X], the sum over V, as x @ ones."""
    return x @ jnp.ones((x.shape[-1],), x.dtype)


def inverse_cdf(scaled: jax.Array, key: jax.Array, block: int = 256) -> jax.Array:
    """int32[B]: one draw per row of softmax(scaled) [B, V] (-inf or finfo.min entries
    never drawn), by inverting the row's CDF with one uniform number: the block of
    `block` tokens whose running mass first exceeds u * total, then the token inside it."""
    b, v = scaled.shape
    n_blocks = -(-v // block)
    p = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # the largest is 1
    p = jnp.pad(p, ((0, 0), (0, n_blocks * block - v))).reshape(b, n_blocks, block)
    mass = p @ jnp.ones((block,), p.dtype)  # [B, n_blocks]
    running = jnp.cumsum(mass, axis=-1)
    target = jax.random.uniform(key, (b,), p.dtype) * running[:, -1]
    # the first block whose running mass exceeds the target (rounding can put the target
    # at the total: then the last block that holds any mass)
    j = jnp.minimum(jnp.sum(running <= target[:, None], axis=-1), _last_true(mass > 0))
    inside = jnp.take_along_axis(p, j[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(running - mass, j[:, None], axis=1)[:, 0]
    local = jnp.cumsum(inside, axis=-1)
    i = jnp.sum(local <= (target - before)[:, None], axis=-1)
    i = jnp.clip(i, first_argmax(inside > 0), _last_true(inside > 0))  # a token with mass
    return (j * block + i).astype(jnp.int32)


def _last_true(x: jax.Array) -> jax.Array:
    """int32[B]: the last index where x bool[B, n] is True (0 if none)."""
    idx = jnp.max(jnp.where(x, jnp.arange(x.shape[-1], dtype=jnp.int32), 0), axis=-1)
    return idx.astype(jnp.int32)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[B]: the first index of the maximum over the last axis of x [B, V], like
    jnp.argmax for finite input, as a max and then a min over matching indices. A row
    without a finite maximum (all NaN) gives index 0."""
    best = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(x == best, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
    return jnp.where(idx < x.shape[-1], idx, 0).astype(jnp.int32)


def _split(layers) -> tuple:
    """A stacked layers subtree (leading axis L) -> a tuple of L per-layer trees; one
    already split passes through."""
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    n = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))


def unstack_layers(params):
    """params whose stacked "layers" subtree (leading axis L) is split into a tuple of L
    per-layer trees (the layout `Unrolled` runs as a Python loop)."""
    return {**params, "layers": _split(params["layers"])}


def stack_layers(tree):
    """The inverse of `unstack_layers` (for gradients taken w.r.t. split params); a tree
    whose layers are stacked passes through."""
    layers = tree["layers"]
    if not isinstance(layers, (tuple, list)):
        return tree
    return {**tree, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


@dataclasses.dataclass(frozen=True)
class Unrolled:
    """Per-layer weights and cache arrays, a Python loop over layers (see above). Params
    split by `train_params` / `loop_params` run as a loop; stacked ones without a cache
    run as the scan, with a cache as a loop over slices of the stack."""

    def uncached(self, dec, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        layers = dec.variables["params"]["layers"] if dec.has_variable("params", "layers") else None
        if not isinstance(layers, (tuple, list)):
            return dec.layers(x, positions, mask, None, None)[0]
        block = dec.block()

        def run(p, x):
            return block.apply({"params": p}, x, positions, mask, None, None)[0]

        run = jax.checkpoint(run) if dec.remat else run
        for p in layers:
            x = run(p, x)
        return x

    def cached(self, dec, x: jax.Array, positions: jax.Array, mask: jax.Array, cache: KVCache):
        """Each layer on its own weights and cache arrays, updated in place. Returns
        (x [B, T, D], keys: L arrays [B, K, H, S], values: L arrays [B, K, S, H])."""
        block = dec.block()
        ks, vs = [], []
        for i, p in enumerate(_split(dec.variables["params"]["layers"])):
            x, kv = block.apply({"params": p}, x, positions, mask, LayerKV(cache.k[i], cache.v[i]), cache.index)
            ks.append(kv.k)
            vs.append(kv.v)
        return x, tuple(ks), tuple(vs)

    def over_layers(self, fn: Callable, carry: Any, layers: Any) -> Any:
        if not isinstance(layers, (tuple, list)):
            return jax.lax.scan(lambda c, p: (fn(p, c), None), carry, layers)[0]
        for p in layers:
            carry = fn(p, carry)
        return carry

    def init_cache(self, cfg: ModelConfig, batch_size: int, capacity: int, dtype,
                   mesh: Mesh | None = None) -> KVCache:
        """An empty cache of L arrays per side: keys [B, K, H, S], values [B, K, S, H]."""
        k_shape = (batch_size, cfg.n_kv_heads, cfg.head_dim, capacity)
        v_shape = (batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
        return KVCache(k=tuple(zeros(k_shape, dtype, mesh, "cache_k", True) for _ in range(cfg.n_layers)),
                       v=tuple(zeros(v_shape, dtype, mesh, "cache_v", True) for _ in range(cfg.n_layers)),
                       **empty_rows(batch_size, capacity, mesh))

    def train_params(self, params, dtype):
        """bf16 compute: the layers split once per step (the Python loop); float32: stacked."""
        return unstack_layers(params) if jnp.dtype(dtype) != jnp.float32 else params

    def stored_grads(self, grads):
        """Gradients w.r.t. `train_params` in the stored layout: restacked when split."""
        return stack_layers(grads)

    def loop_params(self, params, dtype):
        """Split per layer and cast to the compute dtype, once, outside the decode loop."""
        return unstack_layers(jax.tree.map(lambda a: a.astype(dtype), params))


UNROLLED = Unrolled()
