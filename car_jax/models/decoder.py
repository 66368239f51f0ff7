"""Decoder-only transformer in Flax (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3).

One module computes what the Hugging Face model computes: GQA attention with RoPE,
RMSNorm (pre-norm), SwiGLU MLP, optional q/k/v (and o, mlp) biases, optional Qwen3
q/k RMSNorm over the head dim, tied or untied embeddings. Layers are stacked with
`nn.scan` (params carry a leading L axis) so compile time does not grow with depth.
With a KV cache (prefill and decode) the same blocks run as a Python loop over layers
instead, each on its own weights and cache arrays: on CPU, a scan copies every layer's
weights and cache slice out of the stacks on each step. Without a cache, params whose
layers were split by the caller (`unstack_layers`; the bf16 train steps on CPU do) also
run as a Python loop.

`dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; norms,
softmax and RoPE run in float32, logits are returned in float32.
Letters: see `car_jax.models.config`.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from car_jax.models.cache import KVCache
from car_jax.models.config import ModelConfig
from car_jax.models.fused import dot32, softmax, swiglu, transposed

Dtype = Any
_init = nn.initializers.normal(0.02)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Dtype) -> jax.Array:
    """x [..., D] normalised in float32, then scaled in `dtype` (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * y.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """x [N, prod(In)] @ w [*In, *Out] (same dtype; the first n_in axes of w contracted)
    -> float32 [N, prod(Out)], accumulated in float32. w is reshaped to 2D inside, so the
    backward pass keeps w itself (in a layer scan: a slice of the stacked weights, which
    needs no stack of its own) rather than a reshaped copy of it."""
    return dot32(x, _as_2d(w, n_in))


def _as_2d(w: jax.Array, n_in: int) -> jax.Array:
    return w.reshape(int(np.prod(w.shape[:n_in])), -1)


def _matmul_fwd(x, w, n_in):
    return _matmul(x, w, n_in), (x, w)


def _matmul_bwd(n_in, res, g):
    # both gradient matmuls in the operands' dtype with float32 accumulation, like the
    # forward: autodiff would run them on the float32 cotangent, at float32 speed
    x, w = res
    w2 = _as_2d(w, n_in)
    g = g.astype(x.dtype)
    dx = dot32(g, transposed(w2)).astype(x.dtype)
    dw = dot32(transposed(x), g).astype(w.dtype)
    return dx, dw.reshape(w.shape)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x: jax.Array, w: jax.Array, n_in: int, dtype: Dtype) -> jax.Array:
    """x [..., *In] times w [*In, *Out] (the first n_in axes of w are contracted) as one
    2D matmul [N, prod(In)] x [prod(In), prod(Out)] in `dtype` with float32 accumulation,
    the result cast to `dtype`. The reshapes are free; XLA:CPU then never transposes a
    weight to fit its dot (it does for some multi-axis einsums, on every call), and bf16
    products run at bf16 speed in the backward pass too."""
    n_out = w.ndim - n_in
    n = int(np.prod(w.shape[:n_in]))
    y = _matmul(x.astype(dtype).reshape(-1, n), w.astype(dtype), n_in).astype(dtype)
    return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[w.ndim - n_out:])


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention. x [B, T, n, H], positions int32[B, T]."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype

    def _p(self, name, shape, init=_init):
        return self.param(name, init, shape, self.param_dtype).astype(self.dtype)

    def _w(self, name, shape):  # a weight, kept in its storage dtype until `dense` casts it
        return self.param(name, _init, shape, self.param_dtype)

    @nn.compact
    def __call__(self, x, positions, mask, cache_kv, index):
        """x [B, T, D]; positions int32[B, T]; mask bool[B, T, S'] (which keys each query
        sees). Without a cache (cache_kv None) the keys are this chunk's own (S' = T).
        With one, cache_kv is this layer's (keys [B, K, H, S], values [B, K, S, H]): the
        chunk's keys and values are first written at slots [index, index + T), then every
        query attends over all S slots (S' = S), reading the cache in place.
        Returns (y [B, T, D], the updated (k, v) or None)."""
        c = self.cfg
        n, k_heads, h, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
        q = dense(x, self._w("q", (d, n, h)), 1, self.dtype)  # [B, T, N, H]
        k = dense(x, self._w("k", (d, k_heads, h)), 1, self.dtype)  # [B, T, K, H]
        v = dense(x, self._w("v", (d, k_heads, h)), 1, self.dtype)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + self._p("q_bias", (n, h), zeros)
            k = k + self._p("k_bias", (k_heads, h), zeros)
            v = v + self._p("v_bias", (k_heads, h), zeros)
        if c.qk_norm:
            ones = nn.initializers.ones
            q = rms_norm(q, self.param("q_norm", ones, (h,), self.param_dtype), c.norm_eps, self.dtype)
            k = rms_norm(k, self.param("k_norm", ones, (h,), self.param_dtype), c.norm_eps, self.dtype)
        q = rope(q, positions, c.rope_theta)
        k = rope(k, positions, c.rope_theta)

        b, t = x.shape[:2]

        def project(out):  # [B, T, K, G, H] -> [B, T, D]
            y = dense(out.reshape(b, t, n, h), self._w("o", (n, h, d)), 2, self.dtype)
            return y + self._p("o_bias", (d,), nn.initializers.zeros) if c.out_bias else y

        q = q.reshape(b, t, k_heads, c.n_groups, h) * (h ** -0.5)  # [B, T, K, G, H]
        neg = jnp.finfo(jnp.float32).min
        if cache_kv is None:
            scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
            probs = softmax(jnp.where(mask[:, None, None], scores, neg)).astype(self.dtype)
            return project(jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)), None
        # write first, then read the whole cache: the buffers are updated in place
        keys = jax.lax.dynamic_update_slice(cache_kv[0], k.transpose(0, 2, 3, 1).astype(cache_kv[0].dtype),
                                            (0, 0, 0, index))  # [B, K, H, S]
        values = jax.lax.dynamic_update_slice(cache_kv[1], v.swapaxes(1, 2).astype(cache_kv[1].dtype),
                                              (0, 0, index, 0))  # [B, K, S, H]
        # queries as [B, K, T*G, H], so both products are plain batched matmuls over the
        # cache: [M, H] @ [H, S] and [M, S] @ [S, H] (for a decode step, T = 1, the
        # transposes of q and of the output are free). They run in the cache's dtype
        # (`cache.cache_dtype`: float32 on CPU), reading it as it is stored.
        g, s, cd = c.n_groups, values.shape[2], keys.dtype
        qm = q.transpose(0, 2, 1, 3, 4).reshape(b, k_heads, t * g, h).astype(cd)
        scores = jnp.einsum("BKMH,BKHS->BKMS", qm, keys, preferred_element_type=jnp.float32)
        # the mask widened to the queries' [T*G] rows, so scores and probs keep one shape
        # (a reshape between them made autodiff keep both a [B, K, T, G, S] and a
        # [B, K, T*G, S] copy of the probabilities for the backward pass)
        mask = jnp.broadcast_to(mask[:, None, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
        probs = softmax(jnp.where(mask, scores, neg)).astype(cd)
        out = jnp.einsum("BKMS,BKSH->BKMH", probs, values).astype(self.dtype)
        return project(out.reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4)), (keys, values)


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x):  # x [B, T, D] -> [B, T, D]
        c = self.cfg
        p = lambda name, shape, init=_init: self.param(name, init, shape, self.param_dtype).astype(self.dtype)
        w = lambda name, shape: self.param(name, _init, shape, self.param_dtype)
        if not c.mlp_bias:  # one op that keeps 2 of the 4 [B, T, F] activations for backward
            wg, wu = w("gate", (c.d_model, c.mlp_dim)), w("up", (c.d_model, c.mlp_dim))
            wd = w("down", (c.mlp_dim, c.d_model))
            y = swiglu(*(a.astype(self.dtype) for a in (x.reshape(-1, c.d_model), wg, wu, wd)))
            return y.reshape(x.shape)
        zeros = nn.initializers.zeros  # with biases: the plain expression
        gate = dense(x, w("gate", (c.d_model, c.mlp_dim)), 1, self.dtype) + p("gate_bias", (c.mlp_dim,), zeros)
        up = dense(x, w("up", (c.d_model, c.mlp_dim)), 1, self.dtype) + p("up_bias", (c.mlp_dim,), zeros)
        y = dense(jax.nn.silu(gate) * up, w("down", (c.mlp_dim, c.d_model)), 1, self.dtype)
        return y + p("down_bias", (c.d_model,), zeros)


class Block(nn.Module):
    """One pre-norm layer; the scan carry is the residual stream."""
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x, positions, mask, cache_kv, index):
        c = self.cfg
        ones = nn.initializers.ones
        h = rms_norm(x, self.param("input_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        attn, new_kv = Attention(c, self.dtype, self.param_dtype, name="attn")(h, positions, mask, cache_kv, index)
        x = x + attn
        h = rms_norm(x, self.param("post_attn_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        x = x + Mlp(c, self.dtype, self.param_dtype, name="mlp")(h)
        return x, new_kv


def _split(layers) -> tuple:
    """A stacked layers subtree (leading axis L) -> a tuple of L per-layer trees; one
    already split passes through."""
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    n = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))


def unstack_layers(params):
    """params whose stacked "layers" subtree (leading axis L) is split into a tuple of L
    per-layer trees. `Decoder` takes either form: split layers run as a Python loop,
    stacked ones as the scan (or, with a KV cache, as a loop over slices of the stack)."""
    return {**params, "layers": _split(params["layers"])}


def stack_layers(tree):
    """The inverse of `unstack_layers` (for gradients taken w.r.t. split params)."""
    layers = tree["layers"]
    if not isinstance(layers, (tuple, list)):
        return tree
    return {**tree, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def cpu_layer_loop(params, dtype):
    """params as a jitted train step should read them for compute dtype `dtype`. On CPU
    with bf16 compute the layers are split (`unstack_layers`), once per step, so the
    model runs as a Python loop: the scan's backward pass stacks bf16 residuals with an
    update that XLA:CPU runs by converting the whole stack at every layer (SmolLM2-135M,
    bf16 gradients of 4 x 8 x 192 tokens: 24.6 s with the scan, 15.0 s with the loop).
    In float32 the scan is as fast at that size and faster on long sequences (the SFT
    steps of `car-jax run`: 16 s against 27 s a step), and compiles in a third of the
    time. On accelerators the stack and the scan stay."""
    if jax.default_backend() == "cpu" and jnp.dtype(dtype) != jnp.float32:
        return unstack_layers(params)
    return params


class Decoder(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat: bool = False  # recompute each layer in the backward pass
    unroll: int = 1  # layers per scan iteration (n_layers: fully unrolled)

    def setup(self):
        c = self.cfg
        block = nn.remat(Block, static_argnums=()) if self.remat else Block
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.n_layers,
            unroll=self.unroll,
        )(c, self.dtype, self.param_dtype, name="layers")
        self.embed = self.param("embed", _init, (c.vocab_size, c.d_model), self.param_dtype)
        self.final_norm = self.param("final_norm", nn.initializers.ones, (c.d_model,), self.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = self.param("lm_head", _init, (c.d_model, c.vocab_size), self.param_dtype)

    def __call__(self, tokens, valid=None, cache: KVCache | None = None, *, return_hidden=False):
        """Causal forward over a chunk of T tokens per row.

        tokens int32[B, T]; valid bool[B, T] (default all True) marks real tokens: invalid
        ones get no position and are never attended to. Without a cache the chunk is the
        whole sequence; with one, its T tokens are written at slots [index, index + T) and
        attend to every valid earlier slot. The caller guarantees index + T <= S.
        Returns (logits float32[B, T, V] or hidden [B, T, D] if return_hidden, new cache).
        """
        b, t = tokens.shape
        valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
        step = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1  # [B, T]
        slot = jnp.arange(t)
        x = self.embed.astype(self.dtype)[tokens]  # [B, T, D]
        if cache is None:
            # causal over valid keys; a query always sees itself (no empty rows)
            mask = ((slot[None, :] <= slot[:, None])[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
            layers = self.variables["params"]["layers"] if self.has_variable("params", "layers") else None
            if isinstance(layers, (tuple, list)):  # split by the caller: a Python loop
                x = self._layer_loop(x, jnp.maximum(step, 0), mask, layers)
            else:
                x, _ = self.layers(x, jnp.maximum(step, 0), mask, None, None)
            new_cache = None
        else:
            x, new_cache = self._cached_layers(x, cache.next_pos[:, None] + jnp.maximum(step, 0), cache, valid)
        x = rms_norm(x, self.final_norm, self.cfg.norm_eps, self.dtype)
        if return_hidden:
            return x, new_cache
        return self.unembed(x), new_cache

    def _layer_loop(self, x, positions, mask, layers):
        """The layers without a cache as a Python loop over per-layer weights (split by
        the caller, `unstack_layers`). On XLA:CPU the scan's backward pass stacks its
        bf16 residuals with an update that converts the whole stack each layer; the loop
        keeps each layer's residuals apart."""
        block = Block(self.cfg, self.dtype, self.param_dtype, parent=None)

        def run(p, x):
            return block.apply({"params": p}, x, positions, mask, None, None)[0]

        run = jax.checkpoint(run) if self.remat else run
        for p in layers:
            x = run(p, x)
        return x

    def _cached_layers(self, x, positions, cache: KVCache, valid):
        """The layers as a Python loop (not the scan), each updating its own cache arrays
        in place. The weights come from `unstack_layers(params)` when the caller split
        them once (the decode loop does on CPU, outside its `while_loop`); otherwise each
        layer's slice of the stack is taken here. Returns (x, new cache)."""
        t = x.shape[1]
        slots = jnp.arange(cache.capacity)
        chunk = cache.index + jnp.arange(t)  # the slots this chunk is written to
        now_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache.index))  # [B, S]
        # every filled earlier slot, this chunk causally, and always the query's own slot
        mask = ((now_valid[:, None, :] & (slots[None, None, :] <= chunk[None, :, None]))
                | (slots[None, None, :] == chunk[None, :, None]))  # [B, T, S]
        block = Block(self.cfg, self.dtype, self.param_dtype, parent=None)
        ks, vs = [], []
        for i, p in enumerate(_split(self.variables["params"]["layers"])):
            x, (k, v) = block.apply({"params": p}, x, positions, mask, (cache.k[i], cache.v[i]), cache.index)
            ks.append(k)
            vs.append(v)
        return x, KVCache(k=tuple(ks), v=tuple(vs), valid=now_valid,
                          next_pos=cache.next_pos + valid.sum(axis=1).astype(jnp.int32), index=cache.index + t)

    def unembed(self, x):
        """hidden [..., D] -> float32 logits [..., V]."""
        rows = int(np.prod(x.shape[:-1]))
        if self.cfg.tie_embeddings and rows <= 128 and jax.default_backend() == "cpu":
            # a decode step's few rows: XLA:CPU runs x @ E.T over the [V, D] embedding at
            # two thirds of the speed of E @ x.T (SmolLM2, 32 rows: 17 ms against 11 ms).
            # The barrier keeps XLA from folding the transpose back into the dot.
            e = self.embed.astype(self.dtype)
            out = jnp.dot(e, x.reshape(rows, -1).astype(self.dtype).T, preferred_element_type=jnp.float32)  # [V, N]
            return jax.lax.optimization_barrier(out).T.reshape(*x.shape[:-1], -1)
        w = self.embed.T if self.cfg.tie_embeddings else self.lm_head  # [D, V]
        return jnp.einsum("...D,DV->...V", x, w.astype(self.dtype), preferred_element_type=jnp.float32)
