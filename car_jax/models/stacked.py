"""The plain way to run the layers: one `scan` over stacked weights in every mode.

Training, prefill and decode all scan the L layers over the weights' leading L axis, so
the compiled program holds one layer whatever the depth. With a KV cache the scan also
carries the one stacked cache (keys [L, B, K, H, S], values [L, B, K, S, H]): layer l
writes its chunk's slots into the stack in place and attends over its slice
(`cache.StackedKV`). The weights and the cache stay as they are stored: nothing is split,
cast or copied per layer outside the scan. This is the accelerator path; `xla_cpu.Unrolled`
is the CPU one, and the execution policy picks (`models.policy`).
Letters: see `car_jax.dims`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from car_jax.models.cache import KVCache, StackedKV, init_cache
from car_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Scanned:
    """Stacked weights, one stacked cache, a scan over layers in every mode."""

    def uncached(self, dec, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        """The bound Decoder `dec`'s layers without a cache: its `nn.scan` (which also
        creates the stacked params at init). x [B, T, D] -> [B, T, D]."""
        return dec.layers(x, positions, mask, None, None)[0]

    def cached(self, dec, x: jax.Array, positions: jax.Array, mask: jax.Array, cache: KVCache):
        """The layers with the stacked cache: a `lax.scan` over (stacked weights, layer
        index) carrying (x [B, T, D], keys [L, B, K, H, S], values [L, B, K, S, H]).
        Returns (x, keys, values)."""
        block = dec.block()

        def layer(carry, xs):
            x, k, v = carry
            p, i = xs
            x, kv = block.apply({"params": p}, x, positions, mask, StackedKV(k, v, i), cache.index)
            return (x, kv.k, kv.v), None

        layers = dec.variables["params"]["layers"]
        xs = (layers, jnp.arange(dec.cfg.n_layers, dtype=jnp.int32))
        (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), xs, unroll=dec.unroll)
        return x, k, v

    def over_layers(self, fn: Callable, carry: Any, layers: Any) -> Any:
        """carry after fn(layer_params, carry) -> carry for each layer in turn, as a
        `lax.scan` over the stacked `layers` subtree (the prompt-sharing train forward)."""
        return jax.lax.scan(lambda c, p: (fn(p, c), None), carry, layers)[0]

    def init_cache(self, cfg: ModelConfig, batch_size: int, capacity: int, dtype,
                   mesh: Mesh | None = None) -> KVCache:
        return init_cache(cfg, batch_size, capacity, dtype, mesh)

    def train_params(self, params, dtype):
        """The params a train step differentiates: as stored."""
        return params

    def stored_grads(self, grads):
        """Gradients w.r.t. `train_params` in the stored layout: as they are."""
        return grads

    def loop_params(self, params, dtype):
        """The params the decode loop reads: as stored (a cast copy would cost memory)."""
        return params


SCANNED = Scanned()
