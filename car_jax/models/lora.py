"""LoRA adapters as their own params tree: create, split off, join, merge.

The adapters of a model whose config has `lora.rank` > 0 (`ModelConfig.lora`) are declared in
`car_jax.params` beside the weights they adapt ("layers/attn/q_lora_a" [L, D, r],
"layers/attn/q_lora_b" [L, r, N, H], ...). Here they live in a tree of their own that mirrors
those paths ({"layers": {"attn": {"q_lora_a": ..., ...}, "mlp": {...}}}), so the base can be
frozen and the adapters alone trained, optimized and checkpointed:

    adapters = init_adapters(cfg, jax.random.key(0), mesh)   # A kaiming-uniform, B zeros
    params = join(base, adapters)       # what the forward reads: the layers run x W + s (x A) B
    base, adapters = split(params)
    merged = merge_lora(params, cfg)    # base params with W + s A B, adapters gone (export)

with s = alpha / r. The forward applies an adapter wherever the params hold one
(`layers.has_adapters`), so `base` alone is the base model, bit for bit, and a joined tree
whose B are zero computes exactly what the base does.
Letters: see `car_jax.dims` (r: the rank).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from car_jax import sharding as shd
from car_jax.models.config import ModelConfig
from car_jax.models.layers import INITIALIZERS, LORA_DTYPE
from car_jax.params import PARAMS, Param, applicable


def is_adapter(path: str) -> bool:
    """Whether the param at `path` ("layers/attn/q_lora_a") is a LoRA adapter."""
    return path in PARAMS and PARAMS[path].adapts is not None


def declarations(cfg: ModelConfig) -> tuple[Param, ...]:
    """The adapters a model of this config has, in declaration order (none for rank 0)."""
    return tuple(p for p in applicable(cfg) if p.adapts is not None)


def _init_one(p: Param, cfg: ModelConfig, key: jax.Array) -> jax.Array:
    """One adapter of all L layers [L, ...], each layer drawn with its own key (as the
    decoder's layer scan draws them)."""
    keys = jax.random.split(key, cfg.n_layers)
    return jax.vmap(lambda k: INITIALIZERS[p.init](k, p.shape(cfg), LORA_DTYPE))(keys)


def init_adapters(cfg: ModelConfig, key: jax.Array, mesh: Mesh | None = None, mode: str = "train") -> dict[str, Any]:
    """The step-0 adapters of a config: A kaiming-uniform (PEFT's init), B zeros, float32,
    as a tree mirroring their paths; on `mesh`, each laid out by the sharding table (the rank
    axis replicated). Raises ValueError for a config without adapters (lora.rank 0)."""
    decls = declarations(cfg)
    if not decls:
        raise ValueError(f"the model config has no LoRA adapters (lora.rank={cfg.lora.rank}); set model.lora.rank "
                         f"> 0 to train adapters")
    keys = dict(zip((p.path for p in decls), jax.random.split(key, len(decls))))

    def make():
        return shd.unflatten_params({p.path: _init_one(p, cfg, keys[p.path]) for p in decls})

    if mesh is None:
        return jax.jit(make)()
    shapes = jax.eval_shape(make)
    return jax.jit(make, out_shardings=shd.params_shardings(shapes, mesh, mode))()


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A params tree -> (base, adapters): the same leaves, adapters in a tree of their own
    (an empty dict when there are none). Stacked ("layers" a dict) trees only."""
    flat = shd.flatten_params(params)
    base = {p: x for p, x in flat.items() if not is_adapter(p)}
    lora = {p: x for p, x in flat.items() if is_adapter(p)}
    return shd.unflatten_params(base), shd.unflatten_params(lora)


def join(base: Any, adapters: Any) -> Any:
    """The params tree the forward reads: base with the adapters' leaves added at their
    paths (no copy). Either may be split per layer ("layers" a tuple of L trees,
    `xla_cpu.unstack_layers`) as long as both are; adapters None or {} gives base itself,
    and base None (no frozen base: a fully trained model) the second tree itself."""
    if not adapters:
        return base
    if base is None:
        return adapters
    if isinstance(base, Mapping):
        if not isinstance(adapters, Mapping):
            raise TypeError(f"cannot join adapters of type {type(adapters).__name__} onto a dict of params")
        out = dict(base)
        for key, value in adapters.items():
            out[key] = join(base[key], value) if key in base else value
        return out
    if isinstance(base, (tuple, list)):
        if not isinstance(adapters, (tuple, list)) or len(adapters) != len(base):
            raise ValueError("base and adapters must both be stacked or both split into the same number of layers")
        return type(base)(join(b, a) for b, a in zip(base, adapters))
    raise ValueError(f"adapter leaf collides with a base param of shape {getattr(base, 'shape', '?')}")


def delta(a: jax.Array, b: jax.Array, scale: float, stacked: bool = True) -> jax.Array:
    """scale A B in float32, shaped as the weight it adapts: A [L, *In, r], B [L, r, *Out]
    -> [L, *In, *Out] (without the leading L when not `stacked`)."""
    if not stacked:
        return delta(a[None], b[None], scale)[0]
    a2 = a.reshape(a.shape[0], -1, a.shape[-1]).astype(jnp.float32)  # [L, In, r]
    b2 = b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32)  # [L, r, Out]
    out = scale * jnp.einsum("lir,lro->lio", a2, b2, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*a.shape[:-1], *b.shape[2:])


@jax.jit
def _merged(w, a, b, scale):
    return (w.astype(jnp.float32) + delta(a, b, scale)).astype(w.dtype)


def merged_weight(path: str, w: jax.Array, flat_adapters: Mapping[str, Any], cfg: ModelConfig) -> jax.Array:
    """The weight at `path` with its adapters merged in, W + (alpha / r) A B in float32 then
    W's dtype (on W's layout); W itself when `flat_adapters` ({path: array},
    `sharding.flatten_params` of an adapters tree) holds none for it."""
    a, b = flat_adapters.get(path + "_lora_a"), flat_adapters.get(path + "_lora_b")
    if a is None or b is None:
        return w
    return _merged(w, a, b, cfg.lora.scale)


def merge_lora(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A joined params tree (or base and adapters joined first) -> the base params whose
    adapted weights are W + (alpha / r) A B, without adapters: what `save_hf_folder`
    exports. A tree without adapters comes back as it is."""
    base, lora = split(params)
    if not lora:
        return base
    if cfg.lora.rank == 0:
        raise ValueError("the params hold LoRA adapters but the model config has lora.rank=0; pass the config the "
                         "adapters were made for")
    flat, lora_flat = shd.flatten_params(base), shd.flatten_params(lora)
    return shd.unflatten_params({p: merged_weight(p, w, lora_flat, cfg) for p, w in flat.items()})


__all__ = ["init_adapters", "split", "join", "merge_lora", "merged_weight", "delta", "is_adapter", "declarations"]
