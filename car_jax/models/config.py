"""Decoder configuration, read from a Hugging Face `config.json` dict.

Dimension letters (V, D, L, N, K, H, F, G below): see `car_jax.dims`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class UnsupportedConfigError(ValueError):
    """A checkpoint config asks for something this decoder does not compute."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int  # V
    d_model: int  # D
    n_layers: int  # L
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    mlp_dim: int  # F
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2 / Qwen2.5 (and Llama with attention_bias)
    out_bias: bool = False  # Llama with attention_bias also biases o_proj
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over H on q and k before RoPE
    tie_embeddings: bool = False
    max_position: int = 32768
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.n_heads} is not a multiple of "
                f"num_key_value_heads={self.n_kv_heads}")

    @property
    def n_groups(self) -> int:  # G
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds the config from a transformers `config.json` dict.

        Anything that would change the computation and is not implemented raises
        `UnsupportedConfigError` naming the field, instead of being ignored.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type={model_type!r} is not supported; car_jax decodes "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (MoE and other variants are not implemented)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfigError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is implemented")
        if hf.get("use_sliding_window") or (model_type == "llama" and hf.get("sliding_window")):
            raise UnsupportedConfigError(
                "use_sliding_window=True: sliding-window attention is not implemented; "
                "set it to false only if the checkpoint was trained with full attention")
        layer_types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedConfigError(
                f"layer_types={sorted(set(layer_types))}: only 'full_attention' layers are implemented")
        if hf.get("num_experts") or hf.get("num_local_experts"):
            raise UnsupportedConfigError("num_experts: mixture-of-experts layers are not implemented")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedConfigError(f"pretraining_tp={hf['pretraining_tp']}: only 1 is implemented")
        rope_theta = _rope_theta(hf)

        n_heads = hf["num_attention_heads"]
        d_model = hf["hidden_size"]
        head_dim = hf.get("head_dim") or d_model // n_heads
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            d_model=d_model,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            mlp_dim=hf["intermediate_size"],
            rope_theta=rope_theta,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=model_type == "qwen2" or (model_type != "qwen2" and attention_bias),
            out_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The transformers `config.json` dict for this config."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        eos = list(self.eos_token_id)
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.mlp_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        else:
            out["use_sliding_window"] = False
        return out


def _rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from either the transformers-5 `rope_parameters` or the older
    `rope_theta` / `rope_scaling` fields; scaled RoPE variants are refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise UnsupportedConfigError(
                f"{field}.rope_type={kind!r}: only plain RoPE ('default') is implemented")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "fp16": jnp.float16}


def as_dtype(name) -> Any:
    """A dtype name ("float32", "bf16", ...) -> the jnp dtype; a dtype passes through."""
    if not isinstance(name, str):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]
