"""The public model API: `load_model`, `load_tokenizer`, `save_hf`, and `Model`.

Loading sits above both `models` (the decoder) and `checkpoints` (the formats it reads and
writes), so neither imports the other's way back (README, "Layout").
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from car_jax import hosts
from car_jax import sharding as shd
from car_jax.checkpoints.convert import is_params_folder, load_params_folder
from car_jax.checkpoints.gguf_io import GGUFFile
from car_jax.checkpoints.hub import resolve_model_path
from car_jax.checkpoints.loader import load_params, save_hf_folder
from car_jax.checkpoints.safetensors_io import SafetensorsFolder
from car_jax.checkpoints.sources import is_gguf, read_config
from car_jax.checkpoints.sources import load_tokenizer as _load_tokenizer
from car_jax.models.cache import KVCache
from car_jax.models.config import ModelConfig, as_dtype
from car_jax.models.decoder import Decoder
from car_jax.models.policy import ExecutionPolicy, backend_policy


@functools.partial(jax.jit, static_argnums=0)
def _forward(module: Decoder, params, tokens, valid, cache):
    return module.apply({"params": params}, tokens, valid, cache)


@dataclasses.dataclass
class Model:
    """A decoder, its params (placed on `mesh` if given) and where it came from."""
    config: ModelConfig
    params: dict[str, Any]
    module: Decoder
    mesh: Mesh | None = None
    source: Path | None = None

    def logits(self, tokens) -> jax.Array:
        """tokens int32[B, T] (right padding allowed) -> causal logits float32[B, T, V]."""
        tokens = jnp.asarray(tokens, jnp.int32)
        return _forward(self.module, self.params, tokens, None, None)[0]

    def forward(self, tokens, valid=None, cache: KVCache | None = None):
        """One chunk through the model; see `Decoder.__call__`. Returns (logits, cache)."""
        if cache is not None and tokens.shape[1] + int(cache.index) > cache.capacity:
            raise ValueError(f"KV cache overflow: {int(cache.index)} slots used + {tokens.shape[1]} new "
                             f"> capacity {cache.capacity}; allocate a larger cache")
        return _forward(self.module, self.params, tokens, valid, cache)

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache in the layout and dtype of the module's execution policy; on a
        mesh, rows are split over fsdp and kv heads over tp (the sampling table), so no
        device holds the whole cache."""
        return self.module.policy.init_cache(self.config, batch_size, capacity, self.module.dtype, self.mesh)


def load_model(path: str | os.PathLike, *, dtype="float32", param_dtype=None, mesh: Mesh | None = None,
               mode: str = "train", remat: bool = False, progress: bool = True,
               policy: ExecutionPolicy | None = None) -> Model:
    """Loads an HF folder (safetensors, single or sharded), a `.gguf` file or a car_jax
    params folder; a string may also be a hub id ("Qwen/Qwen2.5-3B-Instruct", optionally
    "@revision"), "" or a `builtin:` name (`checkpoints.hub.resolve_model_path`).

    dtype: compute dtype; param_dtype: storage dtype of the weights (default: dtype).
    With `mesh`, each tensor goes straight into its NamedSharding from the table in
    `car_jax.sharding` (`mode` "train" or "sample"). policy: how the model runs
    (`models.policy`; default: the one for the backend jax runs on). A damaged source
    (a tensor missing, misshapen, or holding NaN or inf as loaded) or a config field out of
    range is a CheckpointError naming the file and the tensor or field."""
    path = resolve_model_path(path)
    compute = as_dtype(dtype)
    storage = as_dtype(param_dtype or dtype)
    if is_params_folder(path):  # written by `car-jax convert` / training: orbax params
        cfg = read_config(path)
        abstract = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
        shardings = None if mesh is None else shd.params_shardings(abstract["params"], mesh, mode)
        cfg, params = load_params_folder(path, shardings, dtype=storage)
    else:
        if is_gguf(path):
            source = GGUFFile(path)
            cfg = source.config
        else:
            cfg = read_config(path)
            source = SafetensorsFolder(path)
        params = load_params(source, cfg, dtype=storage, mesh=mesh, mode=mode, progress=progress)
    policy = backend_policy() if policy is None else policy
    module = Decoder(cfg, dtype=compute, param_dtype=storage, remat=remat, policy=policy)
    return Model(cfg, params, module, mesh, path)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer (with its chat template, padding on the left) of any path `load_model`
    takes, a hub id included (`checkpoints.sources.load_tokenizer` of the resolved path)."""
    return _load_tokenizer(resolve_model_path(path))


def save_hf(model: Model, out_dir: str | os.PathLike, *, dtype=None, with_tokenizer: bool = True) -> Path:
    """Writes `model` as an HF folder (config.json, safetensors) that transformers loads;
    the tokenizer of the model's source is written beside it when there is one. With several
    processes every process calls it (the weights are gathered) and process 0 writes."""
    out = save_hf_folder(model.params, model.config, out_dir, dtype=None if dtype is None else as_dtype(dtype))
    if with_tokenizer and model.source is not None and hosts.is_writer():  # several processes: process 0 writes
        try:
            _load_tokenizer(model.source).save_pretrained(str(out))
        except (OSError, ValueError):  # a weights-only source has no tokenizer to carry over
            pass
    return out
