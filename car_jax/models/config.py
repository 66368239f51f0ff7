"""Decoder configuration, read from a Hugging Face `config.json` dict.

Dimension letters (V, D, L, N, K, H, F, G below): see `car_jax.dims`.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp

from car_jax.config import require
from car_jax.params import LORA_TARGETS

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class UnsupportedConfigError(ValueError):
    """A checkpoint config asks for something this decoder does not compute."""


class ConfigFieldError(ValueError):
    """A checkpoint config field is missing or holds the wrong kind of value (a string where
    a number belongs, a negative size): the message names the field, the value and what
    was expected. `checkpoints.sources.read_config` adds the file's name."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the attention and MLP projections (the `model.lora` section):
    each targeted kernel W computes x W + (alpha / rank) (x A) B, A [*In, rank] and
    B [rank, *Out] (`car_jax.params`, `models.lora`). rank 0: no adapters."""
    rank: int = 0  # r; 0: off (the whole model is trained)
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    targets: tuple[str, ...] = tuple(LORA_TARGETS)  # a subset of q, k, v, o, gate, up, down

    def __post_init__(self):
        require(self.rank >= 0, "rank", self.rank, ">= 0 (0: no adapters)")
        require(self.alpha > 0, "alpha", self.alpha, "> 0 (the adapters' scale is alpha / rank)")
        names = ", ".join(LORA_TARGETS)
        require(bool(self.targets), "targets", list(self.targets), f"a non-empty list of: {names}")
        for t in self.targets:
            require(t in LORA_TARGETS, "targets", list(self.targets), f"a list of projections among: {names} "
                    f"({t!r} is none of them)")
        require(len(set(self.targets)) == len(self.targets), "targets", list(self.targets),
                "a list naming each projection once")
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))  # canonical order

    @property
    def scale(self) -> float:
        """alpha / rank (0 without adapters)."""
        return self.alpha / self.rank if self.rank else 0.0


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
    lora: LoraConfig = LoraConfig()  # adapters (none by default); never read from or written to config.json

    @property
    def lora_rank(self) -> int:  # r, the size of the "lora_rank" logical axis
        return self.lora.rank

    def __post_init__(self):
        """The ranges of the fields, however the config was made (`from_hf` checks the kinds
        first): ConfigFieldError naming the HF field."""
        for name, key in _SIZES.items():
            value = getattr(self, name)
            if not (_is_int(value) and 1 <= value <= _INT32_MAX):
                raise ConfigFieldError(f"field {key}={value!r}: expected a positive integer below 2^31")
        for name, key in _SCALES.items():
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and 0 < value <= _FLOAT32_MAX):
                raise ConfigFieldError(f"field {key}={value!r}: expected a positive finite number "
                                       f"(at most {_FLOAT32_MAX:.4g}, float32's range)")
        if self.head_dim % 2:
            raise ConfigFieldError(f"field head_dim={self.head_dim}: expected an even number "
                                   f"(RoPE rotates pairs of dimensions)")
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
        `UnsupportedConfigError` naming the field, instead of being ignored; a missing size
        or a value of the wrong kind (`"hidden_size": "32"`) raises `ConfigFieldError`
        naming the field, the value and what was expected.
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

        n_heads = _field(hf, "num_attention_heads", _POSITIVE_INT)
        d_model = _field(hf, "hidden_size", _POSITIVE_INT)
        if hf.get("head_dim") is None and d_model % n_heads:
            raise ConfigFieldError(f"field hidden_size={d_model} is not a multiple of num_attention_heads={n_heads} "
                                   f"and there is no head_dim to say the heads' width")
        head_dim = _field(hf, "head_dim", _POSITIVE_INT, d_model // n_heads)
        return cls(
            model_type=model_type,
            vocab_size=_field(hf, "vocab_size", _POSITIVE_INT),
            d_model=d_model,
            n_layers=_field(hf, "num_hidden_layers", _POSITIVE_INT),
            n_heads=n_heads,
            n_kv_heads=_field(hf, "num_key_value_heads", _POSITIVE_INT, n_heads),
            head_dim=head_dim,
            mlp_dim=_field(hf, "intermediate_size", _POSITIVE_INT),
            rope_theta=rope_theta,
            norm_eps=_field(hf, "rms_norm_eps", _POSITIVE_NUMBER, 1e-6),
            qkv_bias=model_type == "qwen2" or _field(hf, "attention_bias", _BOOL, False),
            out_bias=model_type != "qwen2" and _field(hf, "attention_bias", _BOOL, False),
            mlp_bias=_field(hf, "mlp_bias", _BOOL, False),
            qk_norm=model_type == "qwen3",
            tie_embeddings=_field(hf, "tie_word_embeddings", _BOOL, False),
            max_position=_field(hf, "max_position_embeddings", _POSITIVE_INT, 32768),
            bos_token_id=_field(hf, "bos_token_id", _TOKEN_ID, None),
            eos_token_id=_eos_ids(hf),
            pad_token_id=_field(hf, "pad_token_id", _TOKEN_ID, None),
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
    params = _field(hf, "rope_parameters", _MAPPING, None) or {}
    scaling = _field(hf, "rope_scaling", _MAPPING, None) or {}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise UnsupportedConfigError(
                f"{field}.rope_type={kind!r}: only plain RoPE ('default') is implemented")
    if params.get("rope_theta") is not None:
        return _field(params, "rope_theta", _POSITIVE_NUMBER, name="rope_parameters.rope_theta")
    return _field(hf, "rope_theta", _POSITIVE_NUMBER, 10000.0)


# (check, what is expected, conversion) for `_field`; bool is no number here (JSON true is not 1)
def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# ModelConfig field -> its config.json name, for the range checks of __post_init__
_SIZES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
          "mlp_dim": "intermediate_size", "max_position": "max_position_embeddings"}
_SCALES = {"rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}
_INT32_MAX = 2**31 - 1  # sizes become device shapes and int32 indices
_FLOAT32_MAX = 3.4028234663852886e38  # theta and eps are used in float32; nan fails the comparison

_POSITIVE_INT = (lambda v: _is_int(v) and v > 0, "a positive integer", int)
_TOKEN_ID = (lambda v: _is_int(v) and v >= 0, "a token id (an integer >= 0) or null", int)
_POSITIVE_NUMBER = (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0,
                    "a positive number", float)
_BOOL = (lambda v: isinstance(v, bool), "true or false", bool)
_MAPPING = (lambda v: isinstance(v, dict), "an object ({...}) or null", dict)
_REQUIRED = object()


def _field(hf: dict[str, Any], key: str, kind: tuple, default: Any = _REQUIRED, name: str | None = None) -> Any:
    """hf[key] checked against `kind` and converted; a missing or null field gives `default`
    (required without one). Raises ConfigFieldError naming the field (`name`, default `key`)."""
    check, expected, convert = kind
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigFieldError(f"field {name or key} is missing; expected {expected}")
        return default
    if not check(value):
        raise ConfigFieldError(f"field {name or key}={value!r} ({type(value).__name__}): expected {expected}")
    return convert(value)


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """eos_token_id: null, one token id or a list of them -> a tuple."""
    eos = hf.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    for i, token in enumerate(ids):
        if not (_is_int(token) and token >= 0):
            where = f"eos_token_id[{i}]" if isinstance(eos, (list, tuple)) else "eos_token_id"
            raise ConfigFieldError(f"field {where}={token!r} ({type(token).__name__}): expected a token id "
                                   f"(an integer >= 0); eos_token_id is an id, a list of ids or null")
    return tuple(int(t) for t in ids)


DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "fp16": jnp.float16}


def as_dtype(name) -> Any:
    """A dtype name ("float32", "bf16", ...) -> the jnp dtype; a dtype passes through."""
    if not isinstance(name, str):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]
