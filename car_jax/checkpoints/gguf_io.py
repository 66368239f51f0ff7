"""GGUF (llama.cpp) checkpoints: read, dequantize and present as HF-named tensors.

The `gguf` package parses the file and dequantizes every quantization type. Two
llama.cpp conventions are undone here:
  * tensor names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
  * for the `llama` architecture, the converter permutes the rows of q and k so that
    RoPE pairs are interleaved; we permute them back to HF's half-split layout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.models.config import ConfigFieldError, ModelConfig, UnsupportedConfigError

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise CheckpointError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in car_jax's table "
                          f"(unsupported architecture feature?)")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows [n, H/2, 2] -> [n, 2, H/2] per head."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """Tensors of a GGUF file under their HF names, dequantized to float32 on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as err:  # the parser raises bare ValueError/struct errors
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({err})") from err
        self.arch = self.field("general.architecture")
        self._tensors = {hf_name(t.name): t for t in self.reader.tensors}
        self.hf_config = self._hf_config()
        try:
            self.config = ModelConfig.from_hf(self.hf_config)
        except ConfigFieldError as err:
            raise CheckpointError(f"{self.path}: {err} (in the config built from its metadata)") from None

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _hf_config(self) -> dict[str, Any]:
        a = self.arch
        if a not in ("llama", "qwen2", "qwen3"):
            raise UnsupportedConfigError(f"GGUF general.architecture={a!r} is not supported "
                                         f"(llama, qwen2, qwen3)")
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedConfigError(f"GGUF {a}.rope.scaling.type={scaling!r}: scaled RoPE is not implemented")
        n_heads = int(self.field(f"{a}.attention.head_count"))
        d_model = int(self.field(f"{a}.embedding_length"))
        vocab = self.field(f"{a}.vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        cfg = {
            "model_type": a,
            "vocab_size": int(vocab),
            "hidden_size": d_model,
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", n_heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", d_model // n_heads)),
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "hidden_act": "silu",
        }
        if a == "llama":
            cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        return cfg

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the GGUF file")
        t = self._tensors[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims fastest-first
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, self.config.n_heads)
        elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, self.config.n_kv_heads)
        return w


def gguf_tokenizer(g: GGUFFile):
    """A transformers fast tokenizer (with the file's chat template) built from the GGUF
    vocabulary, without torch. Uses transformers' torch-free GGUF tokenizer builders;
    for llama.cpp's `smollm` pre-tokenizer it also splits digits one by one, as
    SmolLM2's own tokenizer.json does."""
    spec = {name: self_field for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if (self_field := g.field(f"tokenizer.{key}")) is not None}
    backend, _ = convert_gguf_tokenizer(g.arch, spec)
    if spec.get("pre_tokenizer_type") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    tokens = spec["tokens"]
    special = {name: tokens[spec[key]] for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")) if spec.get(key) is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=g.field("tokenizer.chat_template"),
        add_bos_token=bool(g.field("tokenizer.ggml.add_bos_token", False)), **special)
