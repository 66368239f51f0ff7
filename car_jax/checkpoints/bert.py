"""HF BERT-family safetensors <-> `car_jax.models.encoder.BertEncoder` params.

The conversion is one table: (HF tensor name, param path, HF->param transform,
param->HF transform). `{i}` in a row stands for the layer index. Tensors are read with the
`safetensors` package (numpy framework). A checkpoint saved from a task model
(`BertForMaskedLM`, ...) prefixes names with `bert.`; both spellings are accepted. Tensors the
encoder does not use (pooler, `embeddings.position_ids`, task heads) are ignored.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from car_jax.checkpoints.safetensors_io import open_safetensors, read_json
from car_jax.models.encoder import EncoderConfig, param_shapes

Transform = Callable[[np.ndarray, EncoderConfig], np.ndarray]


def _same(x, cfg):
    return x


def _transpose(x, cfg):  # torch Linear [out, in] <-> Dense kernel [in, out]
    return x.T


def _in_proj(x, cfg):  # [N*H, D] -> kernel [D, N, H]
    return x.T.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim)


def _in_proj_back(x, cfg):  # kernel [D, N, H] -> [N*H, D]
    return x.reshape(cfg.hidden_size, -1).T


def _heads(x, cfg):  # bias [N*H] -> [N, H]
    return x.reshape(cfg.num_heads, cfg.head_dim)


def _heads_back(x, cfg):  # [N, H] -> [N*H]
    return x.reshape(-1)


def _out_proj(x, cfg):  # [D, N*H] -> kernel [N, H, D]
    return x.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _out_proj_back(x, cfg):  # kernel [N, H, D] -> [D, N*H]
    return x.reshape(-1, cfg.hidden_size).T


# (HF name, param path, to_param, to_hf)
EMBEDDING_TABLE: tuple[tuple[str, str, Transform, Transform], ...] = (
    ("embeddings.word_embeddings.weight", "word_embeddings", _same, _same),
    ("embeddings.position_embeddings.weight", "position_embeddings", _same, _same),
    ("embeddings.token_type_embeddings.weight", "token_type_embeddings", _same, _same),
    ("embeddings.LayerNorm.weight", "embed_ln/scale", _same, _same),
    ("embeddings.LayerNorm.bias", "embed_ln/bias", _same, _same),
)
_P = "encoder.layer.{i}."
LAYER_TABLE: tuple[tuple[str, str, Transform, Transform], ...] = (
    (_P + "attention.self.query.weight", "layer_{i}/attn/q_kernel", _in_proj, _in_proj_back),
    (_P + "attention.self.query.bias", "layer_{i}/attn/q_bias", _heads, _heads_back),
    (_P + "attention.self.key.weight", "layer_{i}/attn/k_kernel", _in_proj, _in_proj_back),
    (_P + "attention.self.key.bias", "layer_{i}/attn/k_bias", _heads, _heads_back),
    (_P + "attention.self.value.weight", "layer_{i}/attn/v_kernel", _in_proj, _in_proj_back),
    (_P + "attention.self.value.bias", "layer_{i}/attn/v_bias", _heads, _heads_back),
    (_P + "attention.output.dense.weight", "layer_{i}/attn/o_kernel", _out_proj, _out_proj_back),
    (_P + "attention.output.dense.bias", "layer_{i}/attn/o_bias", _same, _same),
    (_P + "attention.output.LayerNorm.weight", "layer_{i}/attn_ln/scale", _same, _same),
    (_P + "attention.output.LayerNorm.bias", "layer_{i}/attn_ln/bias", _same, _same),
    (_P + "intermediate.dense.weight", "layer_{i}/mlp_up/kernel", _transpose, _transpose),
    (_P + "intermediate.dense.bias", "layer_{i}/mlp_up/bias", _same, _same),
    (_P + "output.dense.weight", "layer_{i}/mlp_down/kernel", _transpose, _transpose),
    (_P + "output.dense.bias", "layer_{i}/mlp_down/bias", _same, _same),
    (_P + "output.LayerNorm.weight", "layer_{i}/mlp_ln/scale", _same, _same),
    (_P + "output.LayerNorm.bias", "layer_{i}/mlp_ln/bias", _same, _same),
)


def conversion_rows(cfg: EncoderConfig):
    """All (HF name, param path, to_param, to_hf) rows for `cfg`, layers expanded."""
    rows = list(EMBEDDING_TABLE)
    for i in range(cfg.num_layers):
        rows += [(h.format(i=i), p.format(i=i), f, b) for h, p, f, b in LAYER_TABLE]
    return rows


def load_config(folder: str | Path, dtype: str = "float32") -> EncoderConfig:
    """`config.json` of an HF folder -> EncoderConfig."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: pass an HF BERT-family model folder")
    return EncoderConfig.from_hf(read_json(path), dtype=dtype)


def _tensor_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {folder}; save the model with "
            "`save_pretrained(..., safe_serialization=True)`"
        )
    return files


def _get(tree: dict, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _put(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def load_params(folder: str | Path, cfg: EncoderConfig | None = None) -> tuple[dict, EncoderConfig]:
    """HF folder (config.json + *.safetensors) -> (params tree of float32 numpy arrays, cfg).

    Raises ValueError naming the tensor and the expected shape when one is missing or has
    the wrong shape.
    """
    folder = Path(folder)
    cfg = cfg or load_config(folder)
    expected = param_shapes(cfg)
    where: dict = {}  # HF name without "bert." -> (file handle, stored name)
    for file in _tensor_files(folder):
        handle = open_safetensors(file)
        for name in handle.keys():  # accept both "x" and "bert.x"
            where.setdefault(name.removeprefix("bert."), (handle, name))
    params: dict = {}
    for hf_name, path, to_param, to_hf in conversion_rows(cfg):
        want = tuple(_get(expected, path).shape)
        want_hf = to_hf(np.empty(want, np.float32), cfg).shape
        if hf_name not in where:
            raise ValueError(
                f"checkpoint {folder} lacks tensor {hf_name!r} (expected shape {want_hf}); "
                "is it a BERT-family model matching its config.json?"
            )
        handle, stored_name = where[hf_name]
        array = handle.get_tensor(stored_name)
        if tuple(array.shape) != tuple(want_hf):
            raise ValueError(
                f"tensor {hf_name!r} in {folder} has shape {tuple(array.shape)}, "
                f"expected {tuple(want_hf)} from config.json"
            )
        _put(params, path, np.ascontiguousarray(to_param(array.astype(np.float32), cfg)))
    return params, cfg


def to_hf(params: dict, cfg: EncoderConfig) -> dict[str, np.ndarray]:
    """params tree -> {HF tensor name: float32 array}: the inverse of `load_params`."""
    return {
        hf_name: np.ascontiguousarray(to_hf_fn(np.asarray(_get(params, path), np.float32), cfg))
        for hf_name, path, _, to_hf_fn in conversion_rows(cfg)
    }
