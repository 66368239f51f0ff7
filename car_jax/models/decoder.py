"""Decoder-only transformer in Flax (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3).

One module computes what the Hugging Face model computes: GQA attention with RoPE,
RMSNorm (pre-norm), SwiGLU MLP, optional q/k/v (and o, mlp) biases, optional Qwen3
q/k RMSNorm over the head dim, tied or untied embeddings. Layers are stacked with
`nn.scan` (params carry a leading L axis) so compile time does not grow with depth.

`dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; norms,
softmax and RoPE run in float32, logits are returned in float32.
Letters: see `car_jax.models.config`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.config import ModelConfig

Dtype = Any
_init = nn.initializers.normal(0.02)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Dtype) -> jax.Array:
    """x [..., D] normalised in float32, then scaled in `dtype` (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * y.astype(dtype)


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

    @nn.compact
    def __call__(self, x, positions, self_mask, cache_kv, cache_mask):
        """x [B, T, D]; positions int32[B, T]; self_mask bool[B, T, T] (causal, valid keys
        of this chunk); cache_kv None or this layer's cached (k, v) [B, S, K, H], read
        only; cache_mask bool[B, T, S] (valid earlier slots).
        Returns (y [B, T, D], (k, v) [B, T, K, H] of this chunk, for the caller to write)."""
        c = self.cfg
        n, k_heads, h, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
        q = jnp.einsum("BTD,DNH->BTNH", x, self._p("q", (d, n, h)))
        k = jnp.einsum("BTD,DKH->BTKH", x, self._p("k", (d, k_heads, h)))
        v = jnp.einsum("BTD,DKH->BTKH", x, self._p("v", (d, k_heads, h)))
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
        q = q.reshape(b, t, k_heads, c.n_groups, h) * (h ** -0.5)  # [B, T, K, G, H]
        neg = jnp.finfo(jnp.float32).min
        # scores against this chunk's own keys, and (with a cache) against the cached
        # ones; one softmax over both, so the cache is read in place and never copied
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(self_mask[:, None, None], scores, neg)
        if cache_kv is not None:
            ck, cv = cache_kv
            old = jnp.einsum("BTKGH,BSKH->BKGTS", q, ck.astype(self.dtype), preferred_element_type=jnp.float32)
            old = jnp.where(cache_mask[:, None, None], old, neg)
            probs = jax.nn.softmax(jnp.concatenate([old, scores], axis=-1), axis=-1).astype(self.dtype)
            s_old = ck.shape[1]
            out = (jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., :s_old], cv.astype(self.dtype))
                   + jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., s_old:], v))
        else:
            probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
            out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
        y = jnp.einsum("BTNH,NHD->BTD", out.reshape(b, t, n, h), self._p("o", (n, h, d)))
        if c.out_bias:
            y = y + self._p("o_bias", (d,), nn.initializers.zeros)
        return y, (k, v)


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x):  # x [B, T, D] -> [B, T, D]
        c = self.cfg
        p = lambda name, shape, init=_init: self.param(name, init, shape, self.param_dtype).astype(self.dtype)
        gate = jnp.einsum("BTD,DF->BTF", x, p("gate", (c.d_model, c.mlp_dim)))
        up = jnp.einsum("BTD,DF->BTF", x, p("up", (c.d_model, c.mlp_dim)))
        if c.mlp_bias:
            zeros = nn.initializers.zeros
            gate = gate + p("gate_bias", (c.mlp_dim,), zeros)
            up = up + p("up_bias", (c.mlp_dim,), zeros)
        y = jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, p("down", (c.mlp_dim, c.d_model)))
        if c.mlp_bias:
            y = y + p("down_bias", (c.d_model,), nn.initializers.zeros)
        return y


class Block(nn.Module):
    """One pre-norm layer; the scan carry is the residual stream."""
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x, positions, self_mask, cache_mask, cache_kv):
        c = self.cfg
        ones = nn.initializers.ones
        h = rms_norm(x, self.param("input_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        attn, new_kv = Attention(c, self.dtype, self.param_dtype, name="attn")(
            h, positions, self_mask, cache_kv, cache_mask)
        x = x + attn
        h = rms_norm(x, self.param("post_attn_norm", ones, (c.d_model,), self.param_dtype), c.norm_eps, self.dtype)
        x = x + Mlp(c, self.dtype, self.param_dtype, name="mlp")(h)
        return x, new_kv


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
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
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
        # within the chunk: causal over valid keys; a query always sees itself (no empty rows)
        self_mask = ((slot[None, :] <= slot[:, None])[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
        if cache is None:
            positions = jnp.maximum(step, 0)
            cache_mask, cache_kv = None, None
        else:
            positions = cache.next_pos[:, None] + jnp.maximum(step, 0)
            # every filled slot lies before the chunk; unfilled ones are not valid
            cache_mask = jnp.broadcast_to(cache.valid[:, None, :], (b, t, cache.capacity))
            cache_kv = (cache.k, cache.v)

        x = self.embed.astype(self.dtype)[tokens]  # [B, T, D]
        x, (new_k, new_v) = self.layers(x, positions, self_mask, cache_mask, cache_kv)  # new_k [L, B, T, K, H]
        x = rms_norm(x, self.final_norm, self.cfg.norm_eps, self.dtype)

        new_cache = None
        if cache is not None:  # one in-place write of the chunk for all layers
            at = (0, 0, cache.index, 0, 0)
            new_cache = KVCache(
                k=jax.lax.dynamic_update_slice(cache.k, new_k.astype(cache.k.dtype), at),
                v=jax.lax.dynamic_update_slice(cache.v, new_v.astype(cache.v.dtype), at),
                valid=jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache.index)),
                next_pos=cache.next_pos + valid.sum(axis=1).astype(jnp.int32),
                index=cache.index + t)
        if return_hidden:
            return x, new_cache
        return self.unembed(x), new_cache

    def unembed(self, x):
        """hidden [..., D] -> float32 logits [..., V]."""
        w = self.embed.T if self.cfg.tie_embeddings else self.lm_head  # [D, V]
        return jnp.einsum("...D,DV->...V", x, w.astype(self.dtype), preferred_element_type=jnp.float32)
