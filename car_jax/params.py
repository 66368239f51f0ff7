"""Every parameter of the decoder, declared once.

A `Param` names one array of the params tree (its path under "params", "/"-joined), the
logical axis of each dimension of one layer's array, its initializer and the configs it
exists in. Everything else follows from these declarations:
  * its shape for a config: each logical axis is a config attribute (`AXIS_SIZES`);
  * its sharding: `car_jax.sharding.PARAM_AXES` (path -> full logical axes) is read from here;
  * its creation: `models.layers.declared_param` creates a param only from its declaration,
    with the declared shape and initializer;
  * its checkpoint tensor: `checkpoints.table` names only the HF tensor and the layout,
    the HF shape is this shape mapped back through the layout.

Params under "layers/" are stacked over the L layers (the decoder's layer scan creates them
with a leading L axis): their full logical axes and shape get a leading "layers" / L.

LoRA adapters are declared beside the weight they adapt (`adapts`): for a kernel
W [*In, *Out] (einsum-ready: q [D, N, H], o [N, H, D], gate [D, F], ...) a pair
A [*In, r] ("<weight>_lora_a", PEFT's kaiming-uniform init) and B [r, *Out]
("<weight>_lora_b", zeros), so that x W + (alpha / r) (x A) B is the adapted projection.
They exist in a config whose `lora.rank` > 0 and whose `lora.targets` name the weight
(`LORA_TARGETS`); the rank axis "lora_rank" has no sharding rule (replicated). The
adapters are kept as their own tree, mirroring these paths (`models.lora`); the
checkpoint table has no entry for them.

The config is duck-typed (a `models.config.ModelConfig`: this module sits below models):
the sizes of `AXIS_SIZES` and the flags qkv_bias, out_bias, qk_norm, mlp_bias,
tie_embeddings, and `lora` (rank, targets). Letters: see `car_jax.dims` (r: the LoRA rank).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

ModelLike = Any  # a models.config.ModelConfig, read by attribute
# normal: N(0, INIT_STD); lora_a: PEFT's kaiming-uniform, U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
# fan_in the product of all axes but the last (the rank)
Init = Literal["normal", "zeros", "ones", "lora_a"]
INIT_STD = 0.02
LAYERS = "layers"  # the scope of the stacked per-layer params, and their leading logical axis

# logical axis -> the config attribute that sizes it
AXIS_SIZES: dict[str, str] = {
    "vocab": "vocab_size",  # V
    "embed": "d_model",  # D, a weight's model-width axis (split over fsdp in training)
    "norm": "d_model",  # D, a norm scale or an output bias (never split)
    "heads": "n_heads",  # N
    "kv_heads": "n_kv_heads",  # K
    "head_dim": "head_dim",  # H
    "mlp": "mlp_dim",  # F
    "layers": "n_layers",  # L
    "lora_rank": "lora_rank",  # r, a LoRA adapter's rank (0 without adapters)
}

# LoRA target name (model.lora.targets) -> the weight it adapts
LORA_TARGETS: dict[str, str] = {
    "q": "layers/attn/q", "k": "layers/attn/k", "v": "layers/attn/v", "o": "layers/attn/o",
    "gate": "layers/mlp/gate", "up": "layers/mlp/up", "down": "layers/mlp/down",
}


def _always(cfg: ModelLike) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # under "params": "embed", "layers/attn/q"
    axes: tuple[str, ...]  # logical axes of one layer's array: ("embed", "heads", "head_dim")
    init: Init = "normal"
    when: Callable[[ModelLike], bool] = _always  # whether a config has this param
    adapts: str | None = None  # a LoRA adapter: the path of the weight it adapts

    def __post_init__(self):
        unknown = [a for a in self.axes if a not in AXIS_SIZES or a == LAYERS]
        if unknown:
            raise ValueError(f"{self.path}: unknown per-layer logical axes {unknown}")

    @property
    def name(self) -> str:
        """The name in its module's scope: "q" for "layers/attn/q"."""
        return self.path.rpartition("/")[2]

    @property
    def stacked(self) -> bool:
        """One array of all L layers (leading axis "layers")."""
        return self.path.startswith(LAYERS + "/")

    @property
    def logical(self) -> tuple[str, ...]:
        """The full logical axes: ("layers", *axes) when stacked."""
        return (LAYERS, *self.axes) if self.stacked else self.axes

    def shape(self, cfg: ModelLike) -> tuple[int, ...]:
        """One layer's shape for `cfg`: q -> (D, N, H)."""
        return tuple(int(getattr(cfg, AXIS_SIZES[a])) for a in self.axes)

    def full_shape(self, cfg: ModelLike) -> tuple[int, ...]:
        """The shape in the params tree: q -> (L, D, N, H)."""
        return (cfg.n_layers, *self.shape(cfg)) if self.stacked else self.shape(cfg)


def _untied(cfg: ModelLike) -> bool:
    return not cfg.tie_embeddings


def _qkv_bias(cfg: ModelLike) -> bool:
    return cfg.qkv_bias


def _out_bias(cfg: ModelLike) -> bool:
    return cfg.out_bias


def _qk_norm(cfg: ModelLike) -> bool:
    return cfg.qk_norm


def _mlp_bias(cfg: ModelLike) -> bool:
    return cfg.mlp_bias


def lora_targets(cfg: ModelLike) -> tuple[str, ...]:
    """The LoRA targets of a config (`LORA_TARGETS` names): () when it has no adapters
    (no `lora` attribute, or rank 0)."""
    lora = getattr(cfg, "lora", None)
    return tuple(lora.targets) if lora is not None and lora.rank > 0 else ()


def _adapters(target: str, n_in: int, axes: tuple[str, ...]) -> tuple[Param, Param]:
    """The LoRA pair of the weight `LORA_TARGETS[target]` whose logical axes are `axes`, the
    first n_in of them contracted: A [*In, r] and B [r, *Out]."""
    weight = LORA_TARGETS[target]

    def when(cfg: ModelLike) -> bool:
        return target in lora_targets(cfg)

    return (Param(weight + "_lora_a", (*axes[:n_in], "lora_rank"), "lora_a", when, weight),
            Param(weight + "_lora_b", ("lora_rank", *axes[n_in:]), "zeros", when, weight))


DECLARED: tuple[Param, ...] = (
    Param("embed", ("vocab", "embed")),  # [V, D]
    Param("lm_head", ("embed", "vocab"), when=_untied),  # [D, V]
    Param("final_norm", ("norm",), "ones"),  # [D]
    Param("layers/input_norm", ("norm",), "ones"),  # [L, D]
    Param("layers/post_attn_norm", ("norm",), "ones"),  # [L, D]
    Param("layers/attn/q", ("embed", "heads", "head_dim")),  # [L, D, N, H]
    *_adapters("q", 1, ("embed", "heads", "head_dim")),  # A [L, D, r], B [L, r, N, H]
    Param("layers/attn/k", ("embed", "kv_heads", "head_dim")),  # [L, D, K, H]
    *_adapters("k", 1, ("embed", "kv_heads", "head_dim")),  # A [L, D, r], B [L, r, K, H]
    Param("layers/attn/v", ("embed", "kv_heads", "head_dim")),  # [L, D, K, H]
    *_adapters("v", 1, ("embed", "kv_heads", "head_dim")),  # A [L, D, r], B [L, r, K, H]
    Param("layers/attn/o", ("heads", "head_dim", "embed")),  # [L, N, H, D]
    *_adapters("o", 2, ("heads", "head_dim", "embed")),  # A [L, N, H, r], B [L, r, D]
    Param("layers/attn/q_bias", ("heads", "head_dim"), "zeros", _qkv_bias),  # [L, N, H]
    Param("layers/attn/k_bias", ("kv_heads", "head_dim"), "zeros", _qkv_bias),  # [L, K, H]
    Param("layers/attn/v_bias", ("kv_heads", "head_dim"), "zeros", _qkv_bias),  # [L, K, H]
    Param("layers/attn/o_bias", ("norm",), "zeros", _out_bias),  # [L, D]
    Param("layers/attn/q_norm", ("head_dim",), "ones", _qk_norm),  # [L, H]
    Param("layers/attn/k_norm", ("head_dim",), "ones", _qk_norm),  # [L, H]
    Param("layers/mlp/gate", ("embed", "mlp")),  # [L, D, F]
    *_adapters("gate", 1, ("embed", "mlp")),  # A [L, D, r], B [L, r, F]
    Param("layers/mlp/up", ("embed", "mlp")),  # [L, D, F]
    *_adapters("up", 1, ("embed", "mlp")),  # A [L, D, r], B [L, r, F]
    Param("layers/mlp/down", ("mlp", "embed")),  # [L, F, D]
    *_adapters("down", 1, ("mlp", "embed")),  # A [L, F, r], B [L, r, D]
    Param("layers/mlp/gate_bias", ("mlp",), "zeros", _mlp_bias),  # [L, F]
    Param("layers/mlp/up_bias", ("mlp",), "zeros", _mlp_bias),  # [L, F]
    Param("layers/mlp/down_bias", ("norm",), "zeros", _mlp_bias),  # [L, D]
)

PARAMS: dict[str, Param] = {p.path: p for p in DECLARED}  # path -> declaration


def declared(path: str) -> Param:
    """The declaration of the param at `path`; KeyError naming this module if there is none."""
    if path not in PARAMS:
        raise KeyError(f"parameter {path!r} is not declared in car_jax.params")
    return PARAMS[path]


def adapter_pair(target: str) -> tuple[Param, Param]:
    """The declarations (A, B) of the LoRA adapters of target `target` ("q", ..., "down")."""
    weight = LORA_TARGETS[target]
    return PARAMS[weight + "_lora_a"], PARAMS[weight + "_lora_b"]


def applicable(cfg: ModelLike) -> tuple[Param, ...]:
    """The params a model of this config has, in declaration order."""
    return tuple(p for p in DECLARED if p.when(cfg))


def shapes(cfg: ModelLike) -> dict[str, tuple[int, ...]]:
    """path -> shape in the params tree ({"layers/attn/q": (L, D, N, H), ...}) of a model
    of this config."""
    return {p.path: p.full_shape(cfg) for p in applicable(cfg)}
