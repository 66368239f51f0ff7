"""BERT-family text encoder (BERT, MiniLM, E5) in Flax, for dense retrieval.

Dimension letters (`car_jax.dims`): B batch, T time (tokens), D model, N heads, H head dim,
F mlp, V vocab, L layers; the position table has `max_positions` rows.

The forward pass is a pure function of (params, token ids, attention mask); `embed` adds the
sentence-embedding head used by sentence-transformers and E5: mean pooling over the attention
mask, then L2 normalization. Dropout is absent: this module is inference only.
Only absolute position embeddings are supported (all BERT/MiniLM/E5 checkpoints use them).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

_ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Shapes and constants of a BERT encoder (hashable: it is a static jit argument)."""

    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # N
    intermediate_size: int  # F
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    dtype: str = "float32"  # compute dtype; params stay float32

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
            )

    @property
    def head_dim(self) -> int:  # H
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], dtype: str = "float32") -> "EncoderConfig":
        """Build from a transformers `config.json` dict of a BERT-family model."""
        position_type = hf.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"position_embedding_type {position_type!r} is not supported; only 'absolute'"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            hidden_act=hf.get("hidden_act", "gelu"),
            dtype=dtype,
        )


def _layer_norm(cfg: EncoderConfig, name: str) -> nn.LayerNorm:
    # exact two-pass variance, as torch.nn.LayerNorm computes it
    return nn.LayerNorm(epsilon=cfg.layer_norm_eps, use_fast_variance=False, name=name)


class Attention(nn.Module):
    cfg: EncoderConfig

    @nn.compact
    def __call__(self, x, bias):  # x [B, T, D], bias [B, 1, 1, T] -> [B, T, D]
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)

        def proj(name):
            w = self.param(f"{name}_kernel", init, (D, N, H))
            b = self.param(f"{name}_bias", nn.initializers.zeros, (N, H))
            return jnp.einsum("BTD,DNH->BTNH", x.astype(dt), w.astype(dt)) + b.astype(dt)

        q, k, v = proj("q"), proj("k"), proj("v")
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) / jnp.sqrt(H)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(dt)  # [B, N, T, S]
        ctx = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        wo = self.param("o_kernel", init, (N, H, D))
        bo = self.param("o_bias", nn.initializers.zeros, (D,))
        return jnp.einsum("BTNH,NHD->BTD", ctx, wo.astype(dt)) + bo.astype(dt)


class Layer(nn.Module):
    cfg: EncoderConfig

    @nn.compact
    def __call__(self, x, bias):  # x [B, T, D] -> [B, T, D]; post-LN as in BERT
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = _layer_norm(cfg, "attn_ln")(x + Attention(cfg, name="attn")(x, bias)).astype(dt)
        h = nn.Dense(cfg.intermediate_size, dtype=dt, name="mlp_up")(x)  # [B, T, F]
        h = nn.Dense(cfg.hidden_size, dtype=dt, name="mlp_down")(_ACTIVATIONS[cfg.hidden_act](h))
        return _layer_norm(cfg, "mlp_ln")(x + h).astype(dt)


class BertEncoder(nn.Module):
    """Token ids [B, T] and attention mask [B, T] (1 = token, 0 = pad) -> hidden [B, T, D]."""

    cfg: EncoderConfig

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids=None):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        T = input_ids.shape[1]
        if T > cfg.max_positions:
            raise ValueError(f"sequence length {T} exceeds max_positions {cfg.max_positions}")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        init = nn.initializers.normal(0.02)
        word = self.param("word_embeddings", init, (cfg.vocab_size, cfg.hidden_size))
        pos = self.param("position_embeddings", init, (cfg.max_positions, cfg.hidden_size))
        typ = self.param("token_type_embeddings", init, (cfg.type_vocab_size, cfg.hidden_size))
        x = word[input_ids] + pos[None, :T] + typ[token_type_ids]  # [B, T, D]
        x = _layer_norm(cfg, "embed_ln")(x).astype(dt)
        # additive key mask: 0 where attended, the most negative float where padded
        keep = attention_mask.astype(bool)[:, None, None, :]  # [B, 1, 1, S]
        bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        for i in range(cfg.num_layers):
            x = Layer(cfg, name=f"layer_{i}")(x, bias)
        return x


def mean_pool(hidden, attention_mask):
    """hidden [B, T, D], mask [B, T] -> [B, D]: mean over unmasked tokens (float32)."""
    m = attention_mask.astype(jnp.float32)[..., None]  # [B, T, 1]
    total = jnp.sum(hidden.astype(jnp.float32) * m, axis=1)
    return total / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def l2_normalize(x, eps: float = 1e-12):
    """x [B, D] -> rows scaled to unit L2 norm (as torch.nn.functional.normalize)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


@partial(jax.jit, static_argnames=("cfg",))
def forward(params, input_ids, attention_mask, *, cfg: EncoderConfig):
    """params, ids [B, T] int32, mask [B, T] -> last hidden state [B, T, D]."""
    return BertEncoder(cfg).apply({"params": params}, input_ids, attention_mask)


@partial(jax.jit, static_argnames=("cfg", "normalize"))
def embed(params, input_ids, attention_mask, *, cfg: EncoderConfig, normalize: bool = True):
    """params, ids [B, T] int32, mask [B, T] -> sentence embeddings [B, D] float32
    (mean pooling over the mask, then L2 normalization unless normalize=False)."""
    hidden = BertEncoder(cfg).apply({"params": params}, input_ids, attention_mask)
    pooled = mean_pool(hidden, attention_mask)
    return l2_normalize(pooled) if normalize else pooled


def param_shapes(cfg: EncoderConfig) -> dict:
    """The parameter tree of `BertEncoder(cfg)` as ShapeDtypeStructs (nothing allocated)."""
    ids = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(lambda: BertEncoder(cfg).init(jax.random.PRNGKey(0), ids, ids))
    return abstract["params"]
