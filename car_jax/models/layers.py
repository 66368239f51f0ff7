"""One decoder layer in Flax (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3): what the Hugging
Face layer computes. GQA attention with RoPE, RMSNorm (pre-norm), SwiGLU MLP, optional
q/k/v (and o, mlp) biases, optional Qwen3 q/k RMSNorm over the head dim.

`dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; norms,
softmax and RoPE run in float32. `transpose` is how the hand-written backward passes
transpose a matmul operand, `attention` which attention runs over a chunk of T tokens and
S keys (`models.flash`: the plain dense one, or a blockwise one for long chunks); both
are the execution policy's (`models.policy`).
Letters: see `car_jax.dims`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from car_jax.models.config import ModelConfig
from car_jax.models.flash import DENSE, NEG, dense_attention
from car_jax.models.fused import dot32, softmax, swiglu

Dtype = Any
_init = nn.initializers.normal(0.02)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Dtype) -> jax.Array:
    """x [..., D] normalised in float32, then scaled in `dtype` (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * y.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x: jax.Array, w: jax.Array, n_in: int, transpose: Callable) -> jax.Array:
    """x [X, prod(In)] @ w [*In, *Out] (same dtype; the first n_in axes of w contracted)
    -> float32 [X, prod(Out)], accumulated in float32. w is reshaped to 2D inside, so the
    backward pass keeps w itself (in a layer scan: a slice of the stacked weights, which
    needs no stack of its own) rather than a reshaped copy of it."""
    return dot32(x, _as_2d(w, n_in))


def _as_2d(w: jax.Array, n_in: int) -> jax.Array:
    return w.reshape(int(np.prod(w.shape[:n_in])), -1)


def _matmul_fwd(x, w, n_in, transpose):
    return _matmul(x, w, n_in, transpose), (x, w)


def _matmul_bwd(n_in, transpose, res, g):
    # both gradient matmuls in the operands' dtype with float32 accumulation, like the
    # forward: autodiff would run them on the float32 cotangent, at float32 speed
    x, w = res
    w2 = _as_2d(w, n_in)
    g = g.astype(x.dtype)
    dx = dot32(g, transpose(w2)).astype(x.dtype)
    dw = dot32(transpose(x), g).astype(w.dtype)
    return dx, dw.reshape(w.shape)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x: jax.Array, w: jax.Array, n_in: int, dtype: Dtype, transpose: Callable = jnp.transpose) -> jax.Array:
    """x [..., *In] times w [*In, *Out] (the first n_in axes of w are contracted) as one
    2D matmul [X, prod(In)] x [prod(In), prod(Out)] in `dtype` with float32 accumulation,
    the result cast to `dtype`. The reshapes are free, no backend transposes a weight to
    fit a multi-axis einsum, and bf16 products stay bf16 in the backward pass too."""
    n_out = w.ndim - n_in
    n = int(np.prod(w.shape[:n_in]))
    y = _matmul(x.astype(dtype).reshape(-1, n), w.astype(dtype), n_in, transpose).astype(dtype)
    return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[w.ndim - n_out:])


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention. x [B, T, n, H] (n heads), positions int32[B, T]."""
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
    transpose: Callable = jnp.transpose
    attention: Any = DENSE  # a `models.flash` variant: where it `handles(T, S)`, it runs

    def _p(self, name, shape, init=_init):
        return self.param(name, init, shape, self.param_dtype).astype(self.dtype)

    def _w(self, name, shape):  # a weight, kept in its storage dtype until `dense` casts it
        return self.param(name, _init, shape, self.param_dtype)

    @nn.compact
    def __call__(self, x, positions, mask, kv, index):
        """x [B, T, D]; positions int32[B, T]; mask bool[B, T, S'] (which keys each query
        sees: a slot mask, `flash.slot_mask`). Without a cache (kv None) the keys are this
        chunk's own (S' = T). With one, kv is this layer's view of the cache
        (`cache.LayerKV` or `cache.StackedKV`): the chunk's keys and values are first written
        at slots [index, index + T), then every query attends over the layer's S slots
        (S' = S), reading the cache in place. Returns (y [B, T, D], the updated view or None)."""
        c = self.cfg
        n, k_heads, h, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
        dense_ = partial(dense, dtype=self.dtype, transpose=self.transpose)
        q = dense_(x, self._w("q", (d, n, h)), 1)  # [B, T, N, H]
        k = dense_(x, self._w("k", (d, k_heads, h)), 1)  # [B, T, K, H]
        v = dense_(x, self._w("v", (d, k_heads, h)), 1)
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
            y = dense_(out.reshape(b, t, n, h), self._w("o", (n, h, d)), 2)
            return y + self._p("o_bias", (d,), nn.initializers.zeros) if c.out_bias else y

        q = q.reshape(b, t, k_heads, c.n_groups, h) * (h ** -0.5)  # [B, T, K, G, H]
        if kv is None:
            out = self.attention(q, k, v, mask, 0) if self.attention.handles(t, t) else dense_attention(q, k, v, mask)
            return project(out), None
        # write first, then read the layer's whole cache: the buffers are updated in place
        keys, values, kv = kv.write(k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), index)  # [B, K, H, S], [B, K, S, H]
        if self.attention.handles(t, values.shape[2]):  # a long chunk (training, prefill), never a decode step
            out = self.attention(q.astype(keys.dtype), keys.transpose(0, 3, 1, 2), values.swapaxes(1, 2), mask, index)
            return project(out.astype(self.dtype)), kv
        # queries as [B, K, T*G, H], so both products are plain batched matmuls over the
        # cache: [T*G, H] @ [H, S] and [T*G, S] @ [S, H] (for a decode step, T = 1, the
        # transposes of q and of the output are free). They run in the cache's dtype,
        # reading it as it is stored.
        g, s, cd = c.n_groups, values.shape[2], keys.dtype
        qm = q.transpose(0, 2, 1, 3, 4).reshape(b, k_heads, t * g, h).astype(cd)
        scores = jnp.matmul(qm, keys, preferred_element_type=jnp.float32)  # [B, K, T*G, S]
        # the mask widened to the queries' T*G rows, so scores and probs keep one shape
        # (a reshape between them made autodiff keep both a [B, K, T, G, S] and a
        # [B, K, T*G, S] copy of the probabilities for the backward pass)
        mask = jnp.broadcast_to(mask[:, None, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
        probs = softmax(jnp.where(mask, scores, NEG)).astype(cd)
        out = jnp.matmul(probs, values).astype(self.dtype)  # [B, K, T*G, H]
        return project(out.reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4)), kv


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    transpose: Callable = jnp.transpose

    @nn.compact
    def __call__(self, x):  # x [B, T, D] -> [B, T, D]
        c = self.cfg
        p = lambda name, shape, init=_init: self.param(name, init, shape, self.param_dtype).astype(self.dtype)
        w = lambda name, shape: self.param(name, _init, shape, self.param_dtype)
        if not c.mlp_bias:  # one op that keeps 2 of the 4 [B, T, F] activations for backward
            wg, wu = w("gate", (c.d_model, c.mlp_dim)), w("up", (c.d_model, c.mlp_dim))
            wd = w("down", (c.mlp_dim, c.d_model))
            y = swiglu(*(a.astype(self.dtype) for a in (x.reshape(-1, c.d_model), wg, wu, wd)),
                       transpose=self.transpose)
            return y.reshape(x.shape)
        zeros = nn.initializers.zeros  # with biases: the plain expression
        dense_ = partial(dense, dtype=self.dtype, transpose=self.transpose)
        gate = dense_(x, w("gate", (c.d_model, c.mlp_dim)), 1) + p("gate_bias", (c.mlp_dim,), zeros)
        up = dense_(x, w("up", (c.d_model, c.mlp_dim)), 1) + p("up_bias", (c.mlp_dim,), zeros)
        y = dense_(jax.nn.silu(gate) * up, w("down", (c.mlp_dim, c.d_model)), 1)
        return y + p("down_bias", (c.d_model,), zeros)


class Block(nn.Module):
    """One pre-norm layer; in a layer scan the carry is the residual stream."""
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    transpose: Callable = jnp.transpose
    attention: Any = DENSE  # the policy's attention variant (`models.flash`)

    @nn.compact
    def __call__(self, x, positions, mask, kv, index):
        """x [B, T, D] -> (x [B, T, D], the updated cache view); arguments as `Attention`."""
        c = self.cfg
        ones = nn.initializers.ones
        h = rms_norm(x, self.param("input_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        attention = Attention(c, self.dtype, self.param_dtype, self.transpose, self.attention, name="attn")
        attn, kv = attention(h, positions, mask, kv, index)
        x = x + attn
        h = rms_norm(x, self.param("post_attn_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        x = x + Mlp(c, self.dtype, self.param_dtype, self.transpose, name="mlp")(h)
        return x, kv
