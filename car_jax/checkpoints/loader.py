"""Streams checkpoint tensors into (possibly sharded) params, and params back to HF.

Loading walks the conversion table one parameter at a time. For each one it asks the
target sharding which slice every local device holds, allocates one host buffer per
distinct slice, and fills it layer by layer with only the rectangle of each HF tensor
that holds the slice (`Entry.hf_index`), read from the file as a slice. No host ever
holds the whole model twice, and with a mesh each process (one per host in a
`jax.distributed` run) reads only the bytes its own devices hold. A source that cannot
read slices (GGUF: quantized blocks) reads each whole tensor once and slices it.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from car_jax import hosts
from car_jax import sharding as shd
from car_jax.checkpoints.safetensors_io import CheckpointError, write_safetensors
from car_jax.checkpoints.table import IGNORED_SUFFIXES, Entry, entries, hf_names
from car_jax.models import lora
from car_jax.models.config import ModelConfig

FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(jnp.bfloat16)}
Index = tuple[slice, ...]


class TensorSource(Protocol):
    def names(self) -> list[str]: ...
    def get(self, name: str) -> np.ndarray: ...


class SlicedSource(Protocol):
    """A source that reads rectangles of a tensor (SafetensorsFolder)."""
    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get_slice(self, name: str, index: Index) -> np.ndarray: ...


class WholeTensors:
    """A SlicedSource over a source that only reads whole tensors: each tensor is read
    once (the last one is kept, since the loader asks for all slices of one tensor in a
    row) and sliced in memory."""

    def __init__(self, source: TensorSource):
        self.source = source
        self._name: str | None = None
        self._tensor: np.ndarray | None = None

    def names(self) -> list[str]:
        return self.source.names()

    def _get(self, name: str) -> np.ndarray:
        if name != self._name:
            self._tensor = None  # the previous tensor goes before the next one is read
            self._tensor, self._name = self.source.get(name), name
        return self._tensor

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)

    def get_slice(self, name: str, index: Index) -> np.ndarray:
        return self._get(name)[index]


def sliced(source: TensorSource | SlicedSource) -> SlicedSource:
    """`source` itself when it reads slices, else WholeTensors(source)."""
    if callable(getattr(source, "get_slice", None)) and callable(getattr(source, "shape", None)):
        return source
    return WholeTensors(source)


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


def _check_shape(source: SlicedSource, entry: Entry, name: str, cfg: ModelConfig) -> None:
    shape, expected = source.shape(name), entry.hf_shape(cfg)
    if tuple(shape) != expected:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, expected {expected} "
                              f"from config.json")


def _read(source: SlicedSource, entry: Entry, name: str, index: Index, cfg: ModelConfig) -> np.ndarray:
    """Param slice `index` (of one layer if stacked) of tensor `name`, in the file's dtype,
    reading only its HF rectangle."""
    piece = source.get_slice(name, entry.hf_index(index, cfg))
    if piece.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} has dtype {piece.dtype}; car_jax loads float16, bfloat16, "
                              f"float32 or float64 weights (dequantize the checkpoint first)")
    return entry.slice_to_jax(piece, index, cfg)


def _slice_key(index: Index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _slice_shape(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _fill(source: SlicedSource, entry: Entry, cfg: ModelConfig, slices: dict[tuple, Index],
          shape: tuple[int, ...], dtype, bar) -> dict[tuple, np.ndarray]:
    """{slice key: host buffer of that param slice}, read tensor by tensor; a stacked
    entry reads, for each slice, only the layers in its layer range."""
    if not entry.stacked:
        _check_shape(source, entry, entry.hf_name, cfg)
        bar.update()
        return {k: np.ascontiguousarray(_read(source, entry, entry.hf_name, ix, cfg), dtype)
                for k, ix in slices.items()}
    buffers = {k: np.empty(_slice_shape(ix, shape), dtype) for k, ix in slices.items()}
    layers = {k: range(*ix[0].indices(cfg.n_layers)) for k, ix in slices.items()}
    for layer, name in enumerate(hf_names(entry, cfg)):
        holders = [k for k in slices if layer in layers[k]]
        if holders:
            _check_shape(source, entry, name, cfg)
        for k in holders:
            buffers[k][layer - layers[k].start] = _read(source, entry, name, slices[k][1:], cfg)
        bar.update()
    return buffers


def load_params(source: TensorSource | SlicedSource, cfg: ModelConfig, *, dtype=jnp.float32,
                mesh: Mesh | None = None, mode: str = "train", progress: bool = True) -> dict[str, Any]:
    """Params tree for `cfg` from an HF-named tensor source, placed on `mesh` per the
    sharding table (`mode` "train" or "sample"), or on the first device without one.

    Each process reads only the HF rectangles of the slices its own devices hold (once per
    distinct slice), so in a multi-process run every process calls this with the same
    arguments and gets its part of each global array. A tensor holding NaN or inf (as
    loaded, in `dtype`) is a CheckpointError naming it (`check_finite`)."""
    check_names(source, cfg)
    where = getattr(source, "folder", None) or getattr(source, "path", None) or "checkpoint"
    source = sliced(source)
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
        buffers = _fill(source, entry, cfg, slices, shape, np_dtype, bar)
        arrays = [jax.device_put(buffers[_slice_key(ix)], d) for d, ix in device_index.items()]
        flat[entry.path] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        del buffers, arrays
    bar.close()
    params = shd.unflatten_params(flat)
    check_finite(params, cfg, where)
    return params


@functools.partial(jax.jit, static_argnums=0)
def _finite_flags(stacked: tuple[bool, ...], arrays: list[jax.Array]) -> jax.Array:
    """bool[M]: for each array in turn, one flag per layer (when stacked) or one for the
    whole array: are all its values finite. One pass over the params, on the device."""
    return jnp.concatenate([jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1) if s else jnp.isfinite(x).all()[None]
                            for s, x in zip(stacked, arrays)])


def check_finite(params: dict[str, Any], cfg: ModelConfig, where: str | os.PathLike) -> None:
    """Raises CheckpointError naming the first HF tensor (in table order) that holds a NaN
    or an inf in `params` as loaded (a damaged file, or values that overflow the storage
    dtype). One jitted reduction and a transfer of a flag per tensor; in a multi-process
    run every process calls it (the flags are gathered)."""
    flat = shd.flatten_params(params)
    rows = entries(cfg)
    ok = hosts.gather_full(_finite_flags(tuple(e.stacked for e in rows), [flat[e.path] for e in rows]))
    if ok.all():
        return
    names = [n for e in rows for n in hf_names(e, cfg)]
    bad = names[int(np.argmin(ok))]
    dtype = flat[rows[0].path].dtype
    raise CheckpointError(f"{where}: tensor {bad!r} holds NaN or inf values as loaded ({dtype}); the checkpoint is "
                          f"damaged or its weights overflow {dtype}: re-download or re-export it, or load it in "
                          f"float32")


def hf_tensors(params: dict[str, Any], cfg: ModelConfig, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) pairs of a params tree, one parameter gathered at a time. A tree
    holding LoRA adapters (`models.lora.join`) yields its adapted weights merged,
    W + (alpha / r) A B, each merged just before its gather (one merged weight at a time).
    In a multi-process run each gather is a collective (`hosts.gather_full`): every process
    must consume the whole iterator, in the same order."""
    base, adapters = lora.split(params)
    flat, flat_adapters = shd.flatten_params(base), shd.flatten_params(adapters)
    if flat_adapters and cfg.lora.rank == 0:
        raise ValueError("the params hold LoRA adapters but the model config has lora.rank=0; pass the config the "
                         "adapters were made for (ModelConfig.lora) to export them merged")
    for entry in entries(cfg):
        x = hosts.gather_full(lora.merged_weight(entry.path, flat[entry.path], flat_adapters, cfg))
        if dtype is not None:
            x = x.astype(dtype)
        names = hf_names(entry, cfg)
        for layer, name in enumerate(names):
            yield name, entry.to_hf(x[layer] if entry.stacked else x, cfg)


def save_hf_folder(params: dict[str, Any], cfg: ModelConfig, out_dir: str | os.PathLike, *,
                   dtype=None, max_shard_bytes: int = 2 << 30) -> Path:
    """Writes `config.json` and safetensors shards that transformers loads.

    In a multi-process run every process must call it (each parameter is gathered with a
    collective); only process 0 (`hosts.is_writer`) writes, the others gather and write
    nothing. Params with LoRA adapters are written merged (`hf_tensors`; the adapters alone:
    `checkpoints.peft.save_peft_folder`). Returns `out_dir` in every process."""
    out = Path(out_dir)
    first = shd.flatten_params(params)[entries(cfg)[0].path]
    save_dtype = np.dtype(dtype or first.dtype)
    tensors = hf_tensors(params, cfg, save_dtype)
    if not hosts.is_writer():
        for _ in tensors:  # the gathers are collectives: take part, keep nothing
            pass
        return out
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = cfg.to_hf()
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16",
                                               "float16": "float16"}[save_dtype.name]
    write_safetensors(tensors, out, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out
