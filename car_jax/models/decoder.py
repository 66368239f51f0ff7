"""Decoder-only transformer in Flax (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3).

One module computes what the Hugging Face model computes: the layers of
`models.layers`, tied or untied embeddings, a final RMSNorm. The weights of the L layers
are stacked (params["layers"] carries a leading L axis, created by an `nn.scan`). How
the layers run is the execution policy's (`models.policy`, a static field): the plain
policy scans them in every mode (`models.stacked`); a policy may run them otherwise
(`models.xla_cpu`) with the same numbers. Attention over a long chunk (the full forward,
a prefill) is the policy's too (`policy.attention`, `models.flash`): blockwise, never
holding [T, S] scores; a decode step (T = 1) keeps the plain matmuls over the cache.

On a mesh a chunk's residual stream keeps its rows over fsdp (`rows`): the weights' D is
split over fsdp in the train layout, and XLA would otherwise follow it, each device
holding [B x T, F] partial sums of every row. A one-token decode step (T = 1) is left to
XLA: there the D-split contraction reduces [B, F] partial sums, fewer bytes than gathering
every layer's weights at every step (measured on a 2-layer model of Qwen2.5-3B's widths,
fsdp = 4, 512 rows, per step: 12.6 MB of collectives against 342 MB, and 115 MB of
temporaries against 380 MB).

`dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; norms,
softmax and RoPE run in float32, logits are returned in float32.
Letters: see `car_jax.dims`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.config import ModelConfig
from car_jax.models.layers import Block, declared_param, rms_norm
from car_jax.models.policy import PLAIN, ExecutionPolicy
from car_jax.sharding import rows_constraint

Dtype = Any


class Decoder(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat: bool = False  # recompute each layer in the backward pass
    unroll: int = 1  # layers per scan iteration (n_layers: fully unrolled)
    policy: ExecutionPolicy = PLAIN  # how the layers run on this backend (static)

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
        )(c, self.dtype, self.param_dtype, self.policy.transpose, self.policy.attention, name="layers")
        self.embed = declared_param(self, "embed", self.param_dtype)  # [V, D]
        self.final_norm = declared_param(self, "final_norm", self.param_dtype)  # [D]
        if not c.tie_embeddings:
            self.lm_head = declared_param(self, "lm_head", self.param_dtype)  # [D, V]

    def block(self) -> Block:
        """One layer as an unbound module, to apply to one layer's params."""
        return Block(self.cfg, self.dtype, self.param_dtype, self.policy.transpose, self.policy.attention,
                     parent=None)

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
        step = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)  # [B, T]
        x = self.rows(self.embed.astype(self.dtype)[tokens])  # [B, T, D]
        if cache is None:
            slot = jnp.arange(t)
            # causal over valid keys; a query always sees itself (no empty rows)
            mask = ((slot[None, :] <= slot[:, None])[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
            x = self.policy.layers.uncached(self, x, step, mask)
            new_cache = None
        else:
            slots = jnp.arange(cache.capacity)
            chunk = cache.index + jnp.arange(t)  # the slots this chunk is written to
            now_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache.index))  # [B, S]
            # every filled earlier slot, this chunk causally, and always the query's own slot
            mask = ((now_valid[:, None, :] & (slots[None, None, :] <= chunk[None, :, None]))
                    | (slots[None, None, :] == chunk[None, :, None]))  # [B, T, S]
            x, k, v = self.policy.layers.cached(self, x, cache.next_pos[:, None] + step, mask, cache)
            new_cache = KVCache(k=k, v=v, valid=now_valid, index=cache.index + t,
                                next_pos=cache.next_pos + valid.sum(axis=1).astype(jnp.int32))
        x = rms_norm(self.rows(x), self.final_norm, self.cfg.norm_eps, self.dtype)
        if return_hidden:
            return x, new_cache
        return self.unembed(x), new_cache

    def rows(self, x):
        """x [B, T, D] with T > 1 (a prefill chunk, a full forward) in the sharding table's
        "hidden" layout (rows over fsdp, D whole; `sharding.rows_constraint`) on the mesh of
        the tracing context or of the weights, x itself without a mesh or with T = 1 (a
        decode step; see the module doc)."""
        return rows_constraint(x, self.embed) if x.shape[1] > 1 else x

    def unembed(self, x):
        """hidden [..., D] -> float32 logits [..., V]."""
        if self.cfg.tie_embeddings:
            return self.policy.tied_unembed(x, self.embed, self.dtype)
        return jnp.einsum("...D,DV->...V", x, self.lm_head.astype(self.dtype), preferred_element_type=jnp.float32)
