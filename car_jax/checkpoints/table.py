"""The conversion table: Hugging Face tensor name <-> car_jax param path, with transforms.

Each entry gives the HF name (with `{i}` for the layer index when the param is stacked
over layers), the param path in car_jax's params tree, the HF shape, and the two
transforms. HF stores linear weights as [out, in]; car_jax keeps einsum-ready kernels
([D, N, H] for q, [N, H, D] for o, [D, F] for gate/up, [F, D] for down).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from car_jax.models.config import ModelConfig

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str  # "model.layers.{i}.self_attn.q_proj.weight"
    path: str  # "layers/attn/q"
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_jax: Transform  # one HF tensor -> one param (one layer of it if stacked)
    to_hf: Transform
    when: Callable[[ModelConfig], bool] = lambda c: True

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name

    def jax_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        one = self.to_jax(np.zeros(self.hf_shape(cfg), np.float32), cfg).shape
        return (cfg.n_layers, *one) if self.stacked else one


def _ident(w, c):
    return w


def _t(w, c):  # [out, in] <-> [in, out]
    return w.T


def _heads_in(n: Callable[[ModelConfig], int]):
    """[n*H, D] (HF q/k/v) <-> [D, n, H]."""
    def to_jax(w, c):
        return w.T.reshape(c.d_model, n(c), c.head_dim)

    def to_hf(x, c):
        return x.reshape(c.d_model, n(c) * c.head_dim).T
    return to_jax, to_hf


def _split_bias(n: Callable[[ModelConfig], int]):
    """[n*H] <-> [n, H]."""
    return (lambda w, c: w.reshape(n(c), c.head_dim), lambda x, c: x.reshape(-1))


_N = lambda c: c.n_heads  # noqa: E731
_K = lambda c: c.n_kv_heads  # noqa: E731
_q, _k = _heads_in(_N), _heads_in(_K)
_qb, _kb = _split_bias(_N), _split_bias(_K)
_L = "model.layers.{i}."


def _o_to_jax(w, c):  # [D, N*H] -> [N, H, D]
    return w.T.reshape(c.n_heads, c.head_dim, c.d_model)


def _o_to_hf(x, c):
    return x.reshape(c.n_heads * c.head_dim, c.d_model).T


TABLE: tuple[Entry, ...] = (
    Entry("model.embed_tokens.weight", "embed", lambda c: (c.vocab_size, c.d_model), _ident, _ident),
    Entry("lm_head.weight", "lm_head", lambda c: (c.vocab_size, c.d_model), _t, _t,
          when=lambda c: not c.tie_embeddings),
    Entry("model.norm.weight", "final_norm", lambda c: (c.d_model,), _ident, _ident),
    Entry(_L + "input_layernorm.weight", "layers/input_norm", lambda c: (c.d_model,), _ident, _ident),
    Entry(_L + "post_attention_layernorm.weight", "layers/post_attn_norm", lambda c: (c.d_model,),
          _ident, _ident),
    Entry(_L + "self_attn.q_proj.weight", "layers/attn/q", lambda c: (c.n_heads * c.head_dim, c.d_model), *_q),
    Entry(_L + "self_attn.k_proj.weight", "layers/attn/k", lambda c: (c.n_kv_heads * c.head_dim, c.d_model), *_k),
    Entry(_L + "self_attn.v_proj.weight", "layers/attn/v", lambda c: (c.n_kv_heads * c.head_dim, c.d_model), *_k),
    Entry(_L + "self_attn.o_proj.weight", "layers/attn/o", lambda c: (c.d_model, c.n_heads * c.head_dim),
          _o_to_jax, _o_to_hf),
    Entry(_L + "self_attn.q_proj.bias", "layers/attn/q_bias", lambda c: (c.n_heads * c.head_dim,), *_qb,
          when=lambda c: c.qkv_bias),
    Entry(_L + "self_attn.k_proj.bias", "layers/attn/k_bias", lambda c: (c.n_kv_heads * c.head_dim,), *_kb,
          when=lambda c: c.qkv_bias),
    Entry(_L + "self_attn.v_proj.bias", "layers/attn/v_bias", lambda c: (c.n_kv_heads * c.head_dim,), *_kb,
          when=lambda c: c.qkv_bias),
    Entry(_L + "self_attn.o_proj.bias", "layers/attn/o_bias", lambda c: (c.d_model,), _ident, _ident,
          when=lambda c: c.out_bias),
    Entry(_L + "self_attn.q_norm.weight", "layers/attn/q_norm", lambda c: (c.head_dim,), _ident, _ident,
          when=lambda c: c.qk_norm),
    Entry(_L + "self_attn.k_norm.weight", "layers/attn/k_norm", lambda c: (c.head_dim,), _ident, _ident,
          when=lambda c: c.qk_norm),
    Entry(_L + "mlp.gate_proj.weight", "layers/mlp/gate", lambda c: (c.mlp_dim, c.d_model), _t, _t),
    Entry(_L + "mlp.up_proj.weight", "layers/mlp/up", lambda c: (c.mlp_dim, c.d_model), _t, _t),
    Entry(_L + "mlp.down_proj.weight", "layers/mlp/down", lambda c: (c.d_model, c.mlp_dim), _t, _t),
    Entry(_L + "mlp.gate_proj.bias", "layers/mlp/gate_bias", lambda c: (c.mlp_dim,), _ident, _ident,
          when=lambda c: c.mlp_bias),
    Entry(_L + "mlp.up_proj.bias", "layers/mlp/up_bias", lambda c: (c.mlp_dim,), _ident, _ident,
          when=lambda c: c.mlp_bias),
    Entry(_L + "mlp.down_proj.bias", "layers/mlp/down_bias", lambda c: (c.d_model,), _ident, _ident,
          when=lambda c: c.mlp_bias),
)

# tensors a checkpoint may carry that car_jax recomputes or does not need
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def entries(cfg: ModelConfig) -> list[Entry]:
    """The table rows that apply to this config."""
    return [e for e in TABLE if e.when(cfg)]


def hf_names(entry: Entry, cfg: ModelConfig) -> list[str]:
    """The HF tensor names of one entry (one per layer if stacked)."""
    if entry.stacked:
        return [entry.hf_name.format(i=i) for i in range(cfg.n_layers)]
    return [entry.hf_name]
