"""Device mesh and the one table of PartitionSpecs.

The mesh has two axes: `fsdp` (parameters and batch split for data parallel training
with sharded weights) and `tp` (tensor parallel: heads, mlp width and vocab split).
Parameters name their dimensions with logical axes (PARAM_AXES, read from their
declarations in `car_jax.params`); a rules table maps
logical axes to mesh axes, with a training variant (weights split over fsdp too) and a
sampling variant (weights only split over tp, so a decode step needs no weight gather).
Modules never build specs themselves: they read this table. `MeshConfig` is the configs'
`mesh` section, built into a mesh by `make_mesh`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax import hosts
from car_jax.config import ConfigError, require
from car_jax.params import DECLARED

MESH_AXES = ("fsdp", "tp")

# param path (joined with "/", under "params") -> logical axis per dimension, stacked
# params with their leading "layers": {"layers/attn/q": ("layers", "embed", "heads", "head_dim"), ...}
PARAM_AXES: dict[str, tuple[str, ...]] = {p.path: p.logical for p in DECLARED}

# activations and caches, by name -> logical axes
DATA_AXES: dict[str, tuple[str, ...]] = {
    "tokens": ("batch", "time"),  # int32[B, T]
    # the stacked KV cache (keys [L, B, K, H, S], values [L, B, K, S, H]); a per-layer cache
    # array is one layer's slice of it (`data_sharding(..., one_layer=True)`)
    "cache_k": ("layers", "batch", "kv_heads", "head_dim", "cache"),
    "cache_v": ("layers", "batch", "kv_heads", "cache", "head_dim"),
    "cache_rows": ("batch", "cache"),  # bool[B, S]
    "rows": ("batch",),  # [B]
    # the residual stream [B, T, D] of every forward (training, prefill, decode;
    # `rows_constraint`): rows split like the batch, D whole on every device ("residual" has
    # no rule: the weights' "embed" axis is split over fsdp in training, the activations'
    # must not be, or each device runs every row's matmuls)
    "hidden": ("batch", "time", "residual"),
}

# logical axis -> mesh axis (absent: replicated)
RULES: dict[str, dict[str, str]] = {
    "train": {"batch": "fsdp", "embed": "fsdp", "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp"},
    "sample": {"batch": "fsdp", "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp"},
}


class ShardingError(ValueError):
    """A mesh that cannot hold a tensor, or axis sizes that do not fit the devices."""


def make_mesh(fsdp: int = -1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (fsdp, tp) mesh over `devices` (default: all). One size may be -1: the rest."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = [fsdp, tp]
    if sizes.count(-1) > 1:
        raise ShardingError(f"at most one mesh axis may be -1, got fsdp={fsdp}, tp={tp}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or n % known:
        raise ShardingError(
            f"mesh fsdp={fsdp} x tp={tp} does not fit {n} devices: the sizes must be positive "
            f"(or -1 for the rest) and their product must divide {n}")
    sizes = [n // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != n:
        raise ShardingError(f"mesh fsdp={sizes[0]} x tp={sizes[1]} uses {math.prod(sizes)} of {n} devices; "
                            f"use -1 for one axis to take the rest")
    axis_types = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types, devices=devices)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The `mesh` section of the train and eval configs: the devices a run spans and the
    (fsdp, tp) mesh over them (`build`)."""
    fsdp: int = -1  # -1: the devices left after tp
    tp: int = 1
    devices: int = 0  # use the first N devices; 0 = all. With one device there is no mesh.

    def __post_init__(self):
        for f in ("fsdp", "tp"):
            require(getattr(self, f) >= 1 or getattr(self, f) == -1, f, getattr(self, f),
                    ">= 1, or -1 for the devices the other axis leaves")
        require(self.tp != -1 or self.fsdp != -1, "tp", self.tp, "a size when fsdp=-1 (one axis at most may be -1)")
        require(self.devices >= 0, "devices", self.devices, ">= 0 (0: all devices)")

    def pick(self, available: Sequence[Any]) -> list:
        """The devices the mesh spans: the first `devices` of `available` (all for 0). Raises
        ConfigError naming mesh.devices when more are asked for than `available` holds, and
        mesh.fsdp when fsdp x tp does not fit the devices picked (checked with two or more:
        one device has no mesh)."""
        n = self.devices or len(available)
        if n > len(available):
            raise ConfigError(f"mesh.devices: {self.devices} devices asked for, but only {len(available)} are "
                              f"available; use at most {len(available)} (or 0 for all of them)")
        known = math.prod(s for s in (self.fsdp, self.tp) if s != -1)
        if n > 1 and (n % known or (-1 not in (self.fsdp, self.tp) and known != n)):
            raise ConfigError(f"mesh.fsdp: fsdp={self.fsdp} x tp={self.tp} does not fit the {n} devices used "
                              f"(mesh.devices={self.devices}, {len(available)} available): the product must be "
                              f"{n}, or divide it with -1 for the axis that takes the rest")
        return list(available[:n])

    def build(self):
        """The (fsdp, tp) jax Mesh over the picked devices of `jax.devices()`; None with one
        device. With several processes the mesh must span all of them (`hosts.check_mesh`)."""
        devices = self.pick(jax.devices())
        mesh = make_mesh(self.fsdp, self.tp, devices) if len(devices) > 1 else None
        hosts.check_mesh(mesh)
        return mesh


def spec_for(logical: Sequence[str], mode: str = "train") -> P:
    """PartitionSpec for a tuple of logical axis names under the `mode` rules."""
    rules = RULES[mode]
    return P(*(rules.get(name) for name in logical))


def _check_divisible(name: str, shape: Sequence[int], logical: Sequence[str], mesh: Mesh, mode: str):
    if len(shape) != len(logical):
        raise ShardingError(f"{name}: shape {tuple(shape)} has {len(shape)} dims, the sharding table "
                            f"names {len(logical)}: {logical}")
    for dim, (size, axis) in enumerate(zip(shape, logical)):
        mesh_axis = RULES[mode].get(axis)
        if mesh_axis is None:
            continue
        n = mesh.shape[mesh_axis]
        if size % n:
            raise ShardingError(
                f"{name}: dim {dim} ({axis}={size}) is not divisible by mesh axis "
                f"'{mesh_axis}' of size {n}; pick a mesh whose '{mesh_axis}' size divides {size}")


def param_sharding(path: str, shape: Sequence[int], mesh: Mesh, mode: str = "train") -> NamedSharding:
    """NamedSharding of the parameter at `path` ("layers/attn/q"), checked for divisibility."""
    if path not in PARAM_AXES:
        raise ShardingError(f"parameter {path!r} is not declared in car_jax.params (no PARAM_AXES entry)")
    logical = PARAM_AXES[path]
    _check_divisible(path, shape, logical, mesh, mode)
    return NamedSharding(mesh, spec_for(logical, mode))


def data_sharding(name: str, shape: Sequence[int], mesh: Mesh, mode: str = "train", *,
                  one_layer: bool = False) -> NamedSharding:
    """NamedSharding of an activation / cache array named in DATA_AXES; with `one_layer`,
    of one layer's slice of a stacked entry (its leading "layers" axis dropped)."""
    logical = DATA_AXES[name]
    if one_layer:
        if logical[0] != "layers":
            raise ShardingError(f"{name}: {logical} has no leading 'layers' axis to take one layer of")
        logical = logical[1:]
    _check_divisible(name, shape, logical, mesh, mode)
    return NamedSharding(mesh, spec_for(logical, mode))


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"layers": {"attn": {"q": x}}} -> {"layers/attn/q": x}."""
    out = {}
    for key, value in params.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flatten_params(value, path))
        else:
            out[path] = value
    return out


def unflatten_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten_params`."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def params_shardings(params: Mapping[str, Any], mesh: Mesh, mode: str = "train") -> dict[str, Any]:
    """A pytree of NamedShardings matching `params` (arrays or ShapeDtypeStructs)."""
    flat = flatten_params(params)
    return unflatten_params({p: param_sharding(p, x.shape, mesh, mode) for p, x in flat.items()})


def rows_constraint(x: jax.Array, like: jax.Array | None = None) -> jax.Array:
    """x [rows, T, D] constrained to the table's "hidden" layout (rows over fsdp, D whole) on
    the mesh in the tracing context (`jax.sharding.use_abstract_mesh`, as `rl.steps`'s jitted
    steps enter it), or else on the mesh `like` (an array, e.g. a weight) is laid out on;
    x itself when neither names a mesh (one device: nothing changes). Without it XLA lays
    the residual stream out as the embedding table (D over fsdp in the train layout) and
    every device runs the matmuls of all the rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty and like is not None:
        placed = jax.typeof(like).sharding
        mesh = placed.mesh if isinstance(placed, NamedSharding) else mesh
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(DATA_AXES["hidden"], "train")))
