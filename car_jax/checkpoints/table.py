"""The conversion table: Hugging Face tensor name <-> car_jax param path, with layouts.

Each entry gives the HF name (with `{i}` for the layer index when the param is stacked
over layers), the param path in car_jax's params tree, and its Layout; the rest is the
param's declaration in `car_jax.params`: whether a config has it (`when`), whether it is
stacked, its shape, and so the HF shape (the declared shape of one layer mapped back through
the Layout: `Layout.hf_shape`). HF stores linear weights as [out, in]; car_jax keeps
einsum-ready kernels ([D, N, H] for q, [N, H, D] for o, [D, F] for gate/up, [F, D] for down).

A Layout says how the HF tensor becomes the param: one HF axis of [n*H] rows (n heads
of H) may be split into [n, H], then the axes are permuted. The whole-tensor transforms
(`to_jax`, `to_hf`) and the slice maps a sharded load needs (`hf_index`: which HF
rectangle holds a slice of the param; `slice_to_jax`: that rectangle -> the slice) all
follow from those two fields, so they cannot disagree.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from car_jax.models.config import ModelConfig
from car_jax.params import Param, declared

Range = tuple[int, int]  # [start, stop) of one axis, step 1


@dataclasses.dataclass(frozen=True)
class Layout:
    heads: int | None = None  # the HF axis of [n*H] rows split into [n, H]; None: no split
    perm: tuple[int, ...] | None = None  # param axis j = axis perm[j] of the split tensor; None: same order

    def split_shape(self, hf_shape: Sequence[int], head_dim: int) -> tuple[int, ...]:
        shape = tuple(hf_shape)
        if self.heads is None:
            return shape
        a = self.heads
        if shape[a] % head_dim:
            raise ValueError(f"HF axis {a} of shape {shape} is not a whole number of heads of {head_dim}")
        return (*shape[:a], shape[a] // head_dim, head_dim, *shape[a + 1:])

    def _permute(self, seq: Sequence) -> tuple:
        return tuple(seq) if self.perm is None else tuple(seq[p] for p in self.perm)

    def hf_shape(self, jax_shape: Sequence[int]) -> tuple[int, ...]:
        """The HF shape of a param of `jax_shape`: the permutation undone, then the split
        [n, H] axes merged into [n*H] rows. q: [D, N, H] -> [N, H, D] -> [N*H, D]."""
        shape = tuple(jax_shape)
        if self.perm is not None:
            shape = tuple(shape[j] for j in np.argsort(self.perm))
        if self.heads is None:
            return shape
        a = self.heads
        return (*shape[:a], shape[a] * shape[a + 1], *shape[a + 2:])

    def jax_shape(self, hf_shape: Sequence[int], head_dim: int) -> tuple[int, ...]:
        return self._permute(self.split_shape(hf_shape, head_dim))

    def _split_ranges(self, index: Sequence[slice], hf_shape: Sequence[int], head_dim: int) -> list[Range]:
        """The [start, stop) of every split-tensor axis selected by a param index."""
        jax_shape = self.jax_shape(hf_shape, head_dim)
        index = (*index, *(slice(None),) * (len(jax_shape) - len(index)))
        if len(index) != len(jax_shape):
            raise ValueError(f"index {index} has more axes than the param shape {jax_shape}")
        ranges: list[Range] = [(0, 0)] * len(jax_shape)
        for j, (s, n) in enumerate(zip(index, jax_shape)):
            lo, hi, step = s.indices(n)
            if step != 1:
                raise ValueError(f"index {index} steps by {step} on axis {j}; only step-1 slices map to a "
                                 f"rectangle of the HF tensor")
            ranges[j if self.perm is None else self.perm[j]] = (lo, max(lo, hi))
        return ranges

    def hf_index(self, index: Sequence[slice], hf_shape: Sequence[int], head_dim: int) -> tuple[slice, ...]:
        """The smallest rectangle of the HF tensor holding param slice `index`. Whole heads
        are contiguous rows (heads n0..n1 -> rows n0*H..n1*H, exactly the slice); a slice
        over head_dim too reads rows n0*H+h0 .. (n1-1)*H+h1, which also hold unused rows."""
        ranges = self._split_ranges(index, hf_shape, head_dim)
        if self.heads is not None:
            a = self.heads
            (n0, n1), (h0, h1) = ranges[a], ranges[a + 1]
            rows = (n0 * head_dim + h0, (n1 - 1) * head_dim + h1) if n1 > n0 and h1 > h0 else (n0 * head_dim,) * 2
            ranges[a:a + 2] = [rows]
        return tuple(slice(lo, hi) for lo, hi in ranges)

    def slice_to_jax(self, piece: np.ndarray, index: Sequence[slice], hf_shape: Sequence[int],
                     head_dim: int) -> np.ndarray:
        """Param slice `index` from `piece`, the HF rectangle `hf_index(index)` of a tensor
        of shape `hf_shape` (the whole tensor when `index` selects everything)."""
        if self.heads is not None:
            a = self.heads
            ranges = self._split_ranges(index, hf_shape, head_dim)
            (n0, n1), (h0, h1) = ranges[a], ranges[a + 1]
            block = (n1 - n0) * head_dim  # rows of the whole heads n0..n1
            if piece.shape[a] != block:  # a head_dim slice: the rows read start h0 into the block
                whole = np.empty((*piece.shape[:a], block, *piece.shape[a + 1:]), piece.dtype)
                whole[(slice(None),) * a + (slice(h0, h0 + piece.shape[a]),)] = piece
                piece = whole
            piece = piece.reshape(*piece.shape[:a], n1 - n0, head_dim, *piece.shape[a + 1:])
            piece = piece[(slice(None),) * (a + 1) + (slice(h0, h1),)]
        return piece if self.perm is None else piece.transpose(self.perm)

    def to_jax(self, w: np.ndarray, head_dim: int) -> np.ndarray:
        return self.slice_to_jax(w, (), w.shape, head_dim)

    def to_hf(self, x: np.ndarray, hf_shape: Sequence[int]) -> np.ndarray:
        if self.perm is not None:
            x = x.transpose(np.argsort(self.perm))
        return x.reshape(hf_shape)


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str  # "model.layers.{i}.self_attn.q_proj.weight"
    path: str  # "layers/attn/q", declared in car_jax.params
    layout: Layout  # one HF tensor <-> one param (one layer of it if stacked)

    def __post_init__(self):
        if ("{i}" in self.hf_name) != self.param.stacked:
            raise ValueError(f"{self.hf_name}: a layer index {{i}} belongs in the HF name exactly when "
                             f"{self.path} is stacked over layers")

    @property
    def param(self) -> Param:
        return declared(self.path)

    @property
    def stacked(self) -> bool:
        return self.param.stacked

    def when(self, cfg: ModelConfig) -> bool:
        """Whether a model of this config has the tensor."""
        return self.param.when(cfg)

    def hf_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The HF tensor's shape (one layer's if stacked)."""
        return self.layout.hf_shape(self.param.shape(cfg))

    def jax_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The param's shape in the params tree (with the leading L if stacked)."""
        return self.param.full_shape(cfg)

    def to_jax(self, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        """One whole HF tensor -> the param (one layer of it if stacked)."""
        return self.layout.to_jax(w, cfg.head_dim)

    def to_hf(self, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        """The param (one layer of it if stacked) -> the HF tensor."""
        return self.layout.to_hf(x, self.hf_shape(cfg))

    def hf_index(self, jax_index: Sequence[slice], cfg: ModelConfig) -> tuple[slice, ...]:
        """The HF rectangle to read for param slice `jax_index` (of one layer if stacked:
        without the layers axis)."""
        return self.layout.hf_index(jax_index, self.hf_shape(cfg), cfg.head_dim)

    def slice_to_jax(self, piece: np.ndarray, jax_index: Sequence[slice], cfg: ModelConfig) -> np.ndarray:
        """The HF rectangle `hf_index(jax_index)` -> param slice `jax_index`."""
        return self.layout.slice_to_jax(piece, jax_index, self.hf_shape(cfg), cfg.head_dim)


_SAME = Layout()  # norms, embedding, biases of whole vectors
_T = Layout(perm=(1, 0))  # [out, in] <-> [in, out]
_HEADS_IN = Layout(heads=0, perm=(2, 0, 1))  # q/k/v [n*H, D] -> [n, H, D] -> [D, n, H]
_HEADS_BIAS = Layout(heads=0)  # [n*H] <-> [n, H]
_HEADS_OUT = Layout(heads=1, perm=(1, 2, 0))  # o [D, N*H] -> [D, N, H] -> [N, H, D]
_L = "model.layers.{i}."

TABLE: tuple[Entry, ...] = (
    Entry("model.embed_tokens.weight", "embed", _SAME),
    Entry("lm_head.weight", "lm_head", _T),
    Entry("model.norm.weight", "final_norm", _SAME),
    Entry(_L + "input_layernorm.weight", "layers/input_norm", _SAME),
    Entry(_L + "post_attention_layernorm.weight", "layers/post_attn_norm", _SAME),
    Entry(_L + "self_attn.q_proj.weight", "layers/attn/q", _HEADS_IN),
    Entry(_L + "self_attn.k_proj.weight", "layers/attn/k", _HEADS_IN),
    Entry(_L + "self_attn.v_proj.weight", "layers/attn/v", _HEADS_IN),
    Entry(_L + "self_attn.o_proj.weight", "layers/attn/o", _HEADS_OUT),
    Entry(_L + "self_attn.q_proj.bias", "layers/attn/q_bias", _HEADS_BIAS),
    Entry(_L + "self_attn.k_proj.bias", "layers/attn/k_bias", _HEADS_BIAS),
    Entry(_L + "self_attn.v_proj.bias", "layers/attn/v_bias", _HEADS_BIAS),
    Entry(_L + "self_attn.o_proj.bias", "layers/attn/o_bias", _SAME),
    Entry(_L + "self_attn.q_norm.weight", "layers/attn/q_norm", _SAME),
    Entry(_L + "self_attn.k_norm.weight", "layers/attn/k_norm", _SAME),
    Entry(_L + "mlp.gate_proj.weight", "layers/mlp/gate", _T),
    Entry(_L + "mlp.up_proj.weight", "layers/mlp/up", _T),
    Entry(_L + "mlp.down_proj.weight", "layers/mlp/down", _T),
    Entry(_L + "mlp.gate_proj.bias", "layers/mlp/gate_bias", _SAME),
    Entry(_L + "mlp.up_proj.bias", "layers/mlp/up_bias", _SAME),
    Entry(_L + "mlp.down_proj.bias", "layers/mlp/down_bias", _SAME),
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
