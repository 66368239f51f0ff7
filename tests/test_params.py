"""The parameter declarations (`car_jax.params`) are the model's params, the sharding table's
and the checkpoint table's: an initialized decoder of each family has exactly the declared
params with the declared shapes, and the checkpoint table's HF names and shapes are those of
the transformers model of the same config."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import torch

from car_jax import params as declarations
from car_jax import sharding as shd
from car_jax.checkpoints.table import TABLE, entries, hf_names
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.layers import declared_param
from tests.hf_factory import BASE, CONFIGS

# plain (tied llama), Qwen2-like (qkv bias, untied lm_head), Qwen3-like (qk norm, H != D / N),
# Llama with every bias (untied)
FAMILIES = ("llama", "qwen2", "qwen3", "llama_bias")


def hf_config(name: str):
    cfg_cls, _, extra = CONFIGS[name]
    return cfg_cls(**{**BASE, **extra})


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, ModelConfig]:
    return request.param, ModelConfig.from_hf(hf_config(request.param).to_dict())


def test_families_cover_every_condition():
    cfgs = [ModelConfig.from_hf(hf_config(n).to_dict()) for n in FAMILIES]
    for flag in ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tie_embeddings"):
        assert {getattr(c, flag) for c in cfgs} == {False, True}, flag


def test_initialized_params_are_the_declared_ones(family):
    """Every param of an initialized decoder is declared with its shape, and every declared
    param that applies to the config exists (no stale declaration)."""
    _, cfg = family
    tree = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    got = {path: x.shape for path, x in shd.flatten_params(tree).items()}
    assert got == declarations.shapes(cfg)
    for path in got:
        assert len(shd.PARAM_AXES[path]) == len(got[path]), path


def test_checkpoint_table_matches_transformers(family):
    """The table's HF names for the config are the transformers model's parameters, with the
    same shapes (the HF shape derived from the declared shape through the layout)."""
    name, cfg = family
    torch.manual_seed(0)
    hf = {n: tuple(p.shape) for n, p in CONFIGS[name][1](hf_config(name)).named_parameters()}
    ours = {n: e.hf_shape(cfg) for e in entries(cfg) for n in hf_names(e, cfg)}
    assert ours == hf


def test_tables_follow_the_declarations():
    # every declared weight has a checkpoint entry; LoRA adapters have none (they export merged, or as PEFT)
    assert [e.path for e in TABLE] == [p.path for p in declarations.DECLARED if p.adapts is None]
    assert all(declarations.PARAMS[p.adapts].adapts is None for p in declarations.DECLARED if p.adapts)
    assert shd.PARAM_AXES == {p.path: p.logical for p in declarations.DECLARED}
    assert all(("{i}" in e.hf_name) == e.stacked == e.path.startswith("layers/") for e in TABLE)
    cfg = ModelConfig("llama", vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    for e in TABLE:  # the layout maps the derived HF shape back to the declared shape
        assert e.layout.jax_shape(e.hf_shape(cfg), cfg.head_dim) == e.param.shape(cfg), e.path
    assert declarations.declared("layers/attn/q").full_shape(cfg) == (3, 32, 4, 8)
    assert TABLE[5].hf_shape(cfg) == (32, 32) and TABLE[8].hf_shape(cfg) == (32, 32)  # q [N*H, D], o [D, N*H]


class _Stray(nn.Module):
    cfg: ModelConfig
    at: str  # the param path it asks for

    @nn.compact
    def __call__(self):
        return declared_param(self, self.at, jnp.float32)


def test_only_declared_params_can_be_created():
    cfg = ModelConfig("llama", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    with pytest.raises(KeyError, match="not declared in car_jax.params"):
        _Stray(cfg, "layers/attn/r").init(jax.random.key(0))
    with pytest.raises(ValueError, match="does not apply"):  # a bias of a config without biases
        _Stray(cfg, "layers/attn/q_bias").init(jax.random.key(0))
    assert _Stray(cfg, "final_norm").init(jax.random.key(0))["params"]["final_norm"].shape == (32,)
