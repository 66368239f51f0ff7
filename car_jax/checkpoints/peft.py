"""LoRA adapters alone, in PEFT's folder layout (what `peft.PeftModel.from_pretrained` reads).

    save_peft_folder(adapters, cfg, "out/peft")   # adapters: `models.lora`'s tree

writes `adapter_config.json` (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
target_modules as the HF module names q_proj .. down_proj) and `adapter_model.safetensors`
with, per layer i and target, `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. car_jax's factors are laid out like its kernels
(A [*In, r], B [r, *Out]; `car_jax.params`), HF's like its Linear weights ([out, in]): A and B
are flattened over their in / out axes in the order of the HF rows and columns (heads, then
head_dim, as the checkpoint table splits them) and transposed, so B_hf @ A_hf is the
transpose of A B, and W_hf + (alpha / r) B_hf @ A_hf is the merged HF weight.
Letters: see `car_jax.dims` (r: the rank).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
from safetensors.numpy import save_file

from car_jax import hosts
from car_jax import sharding as shd
from car_jax.checkpoints.table import TABLE
from car_jax.models.config import ModelConfig
from car_jax.params import LORA_TARGETS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper around the transformers model


def module_name(target: str) -> str:
    """The HF module a target adapts, with `{i}` for the layer: "q" ->
    "model.layers.{i}.self_attn.q_proj" (its weight's name in the checkpoint table)."""
    weight = LORA_TARGETS[target]
    entry = next(e for e in TABLE if e.path == weight)
    return entry.hf_name.removesuffix(".weight")


def peft_tensors(adapters: Mapping[str, Any], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT name, float32 array) of every adapter of every layer: lora_A [r, in], lora_B
    [out, r]. Each adapter is gathered whole first (a collective with several processes:
    every process consumes the whole iterator)."""
    flat = shd.flatten_params(adapters)
    for target in cfg.lora.targets:
        weight = LORA_TARGETS[target]
        a = np.asarray(hosts.gather_full(flat[weight + "_lora_a"]), np.float32)  # [L, *In, r]
        b = np.asarray(hosts.gather_full(flat[weight + "_lora_b"]), np.float32)  # [L, r, *Out]
        r = cfg.lora.rank
        if a.shape[-1] != r or b.shape[1] != r:
            raise ValueError(f"{weight}: adapters of rank {a.shape[-1]} for a config of lora.rank={r}")
        name = PREFIX + module_name(target)
        for i in range(cfg.n_layers):
            yield name.format(i=i) + ".lora_A.weight", a[i].reshape(-1, r).T  # [r, in]
            yield name.format(i=i) + ".lora_B.weight", b[i].reshape(r, -1).T  # [out, r]


def adapter_config(cfg: ModelConfig, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's LoraConfig as JSON for these adapters (no dropout, no bias, plain scaling
    alpha / r: what car_jax computes)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
        "target_modules": [module_name(t).rpartition(".")[2] for t in cfg.lora.targets],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def save_peft_folder(adapters: Mapping[str, Any], cfg: ModelConfig, out_dir: str | os.PathLike, *,
                     base_model: str | None = None) -> Path:
    """Writes `adapter_config.json` and `adapter_model.safetensors` (module docstring) for
    the adapters of `cfg.lora`'s targets. In a multi-process run every process calls it (the
    adapters are gathered) and process 0 writes. Returns `out_dir`."""
    if cfg.lora.rank == 0:
        raise ValueError("the model config has lora.rank=0: there are no adapters to export")
    tensors = dict(peft_tensors(adapters, cfg))
    out = Path(out_dir)
    if not hosts.is_writer():
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2))
    return out
