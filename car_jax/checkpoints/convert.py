"""Conversions between the three checkpoint forms car_jax handles.

  GGUF file           -> HF folder (dequantized float32 safetensors, config, tokenizer)
  HF folder           -> car_jax params folder (orbax params + config.json + tokenizer)
  car_jax params      -> HF folder (transformers loads it)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from car_jax.checkpoints.gguf_io import GGUFFile, gguf_tokenizer
from car_jax.checkpoints.loader import check_finite, check_names, load_params, save_hf_folder
from car_jax.checkpoints.safetensors_io import (
    CheckpointError,
    SafetensorsFolder,
    write_safetensors,
)
from car_jax.checkpoints.sources import PARAMS_MARKER, config_from_file, load_tokenizer, read_config
from car_jax.checkpoints.table import entries, hf_names
from car_jax.models.config import ModelConfig, as_dtype
from car_jax.models.decoder import Decoder


def gguf_to_hf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Dequantizes a GGUF file into an HF folder that transformers (and car_jax) load."""
    g = GGUFFile(src)
    check_names(g, g.config)
    dst = Path(dst)
    names = [n for e in entries(g.config) for n in hf_names(e, g.config)]
    write_safetensors(((n, g.get(n)) for n in names), dst)
    hf = g.config.to_hf()
    hf["dtype"] = hf["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    gguf_tokenizer(g).save_pretrained(str(dst))
    return dst


def save_params(params, cfg: ModelConfig, dst: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Writes params with orbax (sharded arrays stay sharded) beside cfg's config.json and
    the tokenizer of `source` (when it has one), so `load_params_folder` restores them onto
    any mesh."""
    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", params, force=True)
    ckpt.wait_until_finished()
    (dst / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    (dst / PARAMS_MARKER).write_text(json.dumps({"format": "orbax-params", "version": 1}))
    if source is not None:
        try:
            load_tokenizer(source).save_pretrained(str(dst))
        except (OSError, ValueError):
            pass
    return dst


def is_params_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / PARAMS_MARKER).is_file()


def load_params_folder(path: str | os.PathLike, shardings=None, dtype=None):
    """(ModelConfig, params) from a folder written by `save_params`; `shardings` is a
    params-shaped pytree of target shardings (default: the first local device); `dtype`:
    cast to it (default: as saved). NaN or inf in a tensor is a CheckpointError naming it."""
    path = Path(path).absolute()
    cfg = config_from_file(path / "config.json")
    abstract = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 1), "int32")))
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract["params"])
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract["params"],
                          shardings)
    params = ocp.StandardCheckpointer().restore(path / "params", target)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    check_finite(params, cfg, path)
    return cfg, params


def params_to_hf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    cfg, params = load_params_folder(src)
    out = save_hf_folder(params, cfg, dst)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / name).write_bytes((Path(src) / name).read_bytes())
    return out


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "float32") -> tuple[str, Path]:
    """Converts by the kind of `src`; returns (direction, output folder). An HF folder's
    weights are read in `dtype` (their storage dtype in the params folder)."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist; give a .gguf file, an HF folder or a car_jax params folder")
    if src.is_file() and src.suffix == ".gguf":
        return "gguf -> hf", gguf_to_hf(src, dst)
    if is_params_folder(src):
        return "car_jax params -> hf", params_to_hf(src, dst)
    if (src / "config.json").is_file():
        cfg = read_config(src)
        params = load_params(SafetensorsFolder(src), cfg, dtype=as_dtype(dtype), progress=False)
        return "hf -> car_jax params", save_params(params, cfg, dst, source=src)
    raise CheckpointError(f"{src}: not a .gguf file, an HF folder (config.json) or a car_jax params "
                          f"folder ({PARAMS_MARKER})")


