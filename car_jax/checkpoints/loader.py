"""Streams checkpoint tensors into (possibly sharded) params, and params back to HF.

Loading walks the conversion table one parameter at a time. For each one it asks the
target sharding which slice every local device holds, allocates one host buffer per
distinct slice, fills it layer by layer (one HF tensor in memory at a time), and hands
the buffers to their devices. No host ever holds the whole model twice, and with a
mesh each host only materialises the slices its own devices need.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from car_jax import sharding as shd
from car_jax.checkpoints.safetensors_io import CheckpointError, write_safetensors
from car_jax.checkpoints.table import IGNORED_SUFFIXES, Entry, entries, hf_names
from car_jax.models.config import ModelConfig

FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(jnp.bfloat16)}


class TensorSource(Protocol):
    def names(self) -> list[str]: ...
    def get(self, name: str) -> np.ndarray: ...


def check_names(source: TensorSource, cfg: ModelConfig) -> None:
    """Every tensor the config needs is present, and no tensor is left unexplained."""
    expected = {n for e in entries(cfg) for n in hf_names(e, cfg)}
    present = set(source.names())
    allowed_extra = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unknown = sorted(n for n in present - expected - allowed_extra if not n.endswith(IGNORED_SUFFIXES))
    if unknown:
        raise CheckpointError(
            f"unknown tensor(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}: a {cfg.model_type} "
            f"model with this config.json has no such weights; is config.json from the same model?")
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(
            f"tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} missing from the checkpoint "
            f"(needed by config.json: model_type={cfg.model_type}, num_hidden_layers={cfg.n_layers})")


def _read(source: TensorSource, entry: Entry, name: str, cfg: ModelConfig, dtype) -> np.ndarray:
    w = source.get(name)
    expected = entry.hf_shape(cfg)
    if tuple(w.shape) != expected:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {expected} "
                              f"from config.json")
    if w.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} has dtype {w.dtype}; car_jax loads float16, bfloat16, "
                              f"float32 or float64 weights (dequantize the checkpoint first)")
    return entry.to_jax(w, cfg).astype(dtype)


def _slice_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _slice_shape(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def load_params(source: TensorSource, cfg: ModelConfig, *, dtype=jnp.float32, mesh: Mesh | None = None,
                mode: str = "train", progress: bool = True) -> dict[str, Any]:
    """Params tree for `cfg` from an HF-named tensor source, placed on `mesh` per the
    sharding table (`mode` "train" or "sample"), or on the first device without one."""
    check_names(source, cfg)
    np_dtype = np.dtype(dtype)
    flat: dict[str, jax.Array] = {}
    rows = entries(cfg)
    bar = tqdm(total=sum(len(hf_names(e, cfg)) for e in rows), desc="loading weights", unit="tensor",
               disable=not progress or None, leave=False)
    for entry in rows:
        shape = entry.jax_shape(cfg)
        sharding = (shd.param_sharding(entry.path, shape, mesh, mode) if mesh is not None
                    else SingleDeviceSharding(jax.local_devices()[0]))
        device_index = sharding.addressable_devices_indices_map(shape)
        slices = {_slice_key(ix): ix for ix in device_index.values()}
        if entry.stacked:
            buffers = {k: np.empty(_slice_shape(ix, shape), np_dtype) for k, ix in slices.items()}
            for layer, name in enumerate(hf_names(entry, cfg)):
                w = _read(source, entry, name, cfg, np_dtype)
                for k, ix in slices.items():
                    lo, hi, _ = ix[0].indices(cfg.n_layers)
                    if lo <= layer < hi:
                        buffers[k][layer - lo] = w[ix[1:]]
                bar.update()
        else:
            w = _read(source, entry, entry.hf_name, cfg, np_dtype)
            buffers = {k: np.ascontiguousarray(w[ix]) for k, ix in slices.items()}
            del w
            bar.update()
        arrays = [jax.device_put(buffers[_slice_key(ix)], d) for d, ix in device_index.items()]
        flat[entry.path] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        del buffers, arrays
    bar.close()
    return shd.unflatten_params(flat)


def hf_tensors(params: dict[str, Any], cfg: ModelConfig, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) pairs of a params tree, one parameter gathered at a time."""
    flat = shd.flatten_params(params)
    for entry in entries(cfg):
        x = np.asarray(jax.device_get(flat[entry.path]))
        if dtype is not None:
            x = x.astype(dtype)
        names = hf_names(entry, cfg)
        for layer, name in enumerate(names):
            yield name, entry.to_hf(x[layer] if entry.stacked else x, cfg)


def save_hf_folder(params: dict[str, Any], cfg: ModelConfig, out_dir: str | os.PathLike, *,
                   dtype=None, max_shard_bytes: int = 2 << 30) -> Path:
    """Writes `config.json` and safetensors shards that transformers loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(shd.flatten_params(params).values()))
    save_dtype = np.dtype(dtype or first.dtype)
    hf_cfg = cfg.to_hf()
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16",
                                               "float16": "float16"}[save_dtype.name]
    write_safetensors(hf_tensors(params, cfg, save_dtype), out, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out
