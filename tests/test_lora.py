"""LoRA in the model (`models.lora`, `car_jax.params`' adapter declarations): the adapters are
declared params with the declared shapes and a replicated rank axis; without them, or with B
zero, the forward is the base model's bit for bit; with them it is the base model at the
merged weights W + (alpha / r) A B; and the adapters' gradients are the merged weights'
gradients projected through the low-rank factors, for every target, under both execution
policies, through the layer scan and the per-layer loop."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax import params as declarations
from car_jax import sharding as shd
from car_jax.config import load_config
from car_jax.models import lora
from car_jax.models.config import LoraConfig, ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.models.xla_cpu import stack_layers, unstack_layers
from car_jax.params import LORA_TARGETS
from car_jax.rl.batches import micro_batches, to_device
from car_jax.rl.host_batch import host_batch, micro_plan
from car_jax.rl.logprobs import token_logprobs
from car_jax.rl.steps import micro_logprobs
from car_jax.train.config import TrainConfig
from tests.test_train_step import make_trajs

LORA = LoraConfig(rank=4, alpha=8.0)
# no MLP bias: the fused SwiGLU op carries the gate / up / down adapters; with every bias
# (untied head, out bias): the plain MLP expression
FAMILIES = {
    "qwen2": ModelConfig("qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                         mlp_dim=48, qkv_bias=True, lora=LORA),
    "llama_bias": ModelConfig("llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8,
                              mlp_dim=48, qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True,
                              lora=LORA),
}


def random_params(cfg: ModelConfig, seed: int = 0):
    """(base, adapters) of a LoRA decoder of `cfg`: the base at init (biases and norms
    randomised so that a dropped term shows), the adapters random, B included (not zeros)."""
    params = Decoder(cfg).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    base, adapters = lora.split(params)
    rng = np.random.default_rng(seed)
    flat = {p: jnp.asarray(np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32) * (x.ndim <= 2))
            for p, x in shd.flatten_params(base).items()}
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), jnp.float32), adapters)
    return shd.unflatten_params(flat), adapters


def test_adapters_are_declared_and_created():
    """An initialized LoRA decoder has exactly the declared params, adapters included, with
    their declared shapes (A [*In, r], B [r, *Out] for every target's kernel), stored in
    float32 over a bf16 base; B starts at zero and A at PEFT's kaiming-uniform bound; the
    sharding table splits them as the weight's in / out axes and replicates the rank."""
    cfg = dataclasses.replace(FAMILIES["qwen2"], lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "o", "down")))
    module = Decoder(cfg, param_dtype=jnp.bfloat16)
    params = module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    flat = shd.flatten_params(params)
    assert {p: x.shape for p, x in flat.items()} == declarations.shapes(cfg)
    assert {p for p in flat if lora.is_adapter(p)} == {
        "layers/attn/q_lora_a", "layers/attn/q_lora_b", "layers/attn/o_lora_a", "layers/attn/o_lora_b",
        "layers/mlp/down_lora_a", "layers/mlp/down_lora_b"}
    assert flat["layers/attn/q_lora_a"].shape == (2, 32, 4) and flat["layers/attn/q_lora_b"].shape == (2, 4, 4, 8)
    assert flat["layers/attn/o_lora_a"].shape == (2, 4, 8, 4) and flat["layers/attn/o_lora_b"].shape == (2, 4, 32)
    assert flat["layers/mlp/down_lora_a"].shape == (2, 48, 4) and flat["layers/mlp/down_lora_b"].shape == (2, 4, 32)
    for p, x in flat.items():
        assert x.dtype == (jnp.float32 if lora.is_adapter(p) else jnp.bfloat16), p
    assert not np.asarray(flat["layers/attn/q_lora_b"]).any()
    a = np.asarray(flat["layers/attn/o_lora_a"])
    assert 0.5 / np.sqrt(32) < np.abs(a).max() <= 1 / np.sqrt(32)  # fan_in N x H = 32
    assert shd.spec_for(shd.PARAM_AXES["layers/attn/q_lora_a"]) == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert shd.spec_for(shd.PARAM_AXES["layers/attn/q_lora_b"]) == jax.sharding.PartitionSpec(None, None, "tp", None)
    assert shd.spec_for(shd.PARAM_AXES["layers/mlp/down_lora_a"]) == jax.sharding.PartitionSpec(None, "tp", None)
    # the standalone init makes the same tree (shapes, dtypes, zeros for B)
    fresh = lora.init_adapters(cfg, jax.random.key(1))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), fresh) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                            lora.split(params)[1])
    assert all(not np.asarray(x).any() for p, x in shd.flatten_params(fresh).items() if p.endswith("_b"))


def test_lora_config_keys():
    """model.lora.* are config keys, checked when the config loads."""
    cfg = load_config(TrainConfig, None, ["model.lora.rank=8", "model.lora.alpha=32", "model.lora.targets=[down,q]"])
    assert cfg.model.lora == LoraConfig(rank=8, alpha=32.0, targets=("q", "down")) and cfg.model.lora.scale == 4.0
    assert LoraConfig().rank == 0 and LoraConfig().targets == tuple(LORA_TARGETS)
    for bad, match in ((["model.lora.rank=-1"], "rank"), (["model.lora.targets=[q,lm_head]"], "lm_head"),
                       (["model.lora.targets=[q,q]"], "once"), (["model.lora.alpha=0"], "alpha")):
        with pytest.raises(Exception, match=match):
            load_config(TrainConfig, None, bad)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=["plain", "xla_cpu"])
def test_forward_with_zero_or_absent_adapters_is_the_base(family, policy):
    """The LoRA module on the base params alone, and on the base joined with adapters whose
    B is zero, gives the logits of the module without LoRA, exactly; with a KV cache too."""
    cfg = FAMILIES[family]
    base, adapters = random_params(cfg)
    zero_b = {p: (jnp.zeros_like(x) if p.endswith("_b") else x) for p, x in shd.flatten_params(adapters).items()}
    plain = Decoder(dataclasses.replace(cfg, lora=LoraConfig()), policy=policy)
    module = Decoder(cfg, policy=policy)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 7)), jnp.int32)
    want = plain.apply({"params": base}, tokens)[0]
    for params in (base, lora.join(base, shd.unflatten_params(zero_b))):
        assert np.array_equal(module.apply({"params": params}, tokens)[0], want)
        cache = policy.init_cache(cfg, 2, 8, jnp.float32)
        got = module.apply({"params": params}, tokens, None, cache)[0]
        assert np.array_equal(got, plain.apply({"params": base}, tokens, None, cache)[0])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=["plain", "xla_cpu"])
def test_forward_with_adapters_is_the_merged_base(family, policy):
    """With random adapters (B non-zero) the forward, full and chunk by chunk through the KV
    cache, equals the base model at the merged weights W + (alpha / r) A B; and differs
    from the base (the adapters do something)."""
    cfg = FAMILIES[family]
    base, adapters = random_params(cfg)
    params = lora.join(base, adapters)
    merged = lora.merge_lora(params, cfg)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    module = Decoder(cfg, policy=policy)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 9)), jnp.int32)
    want = np.asarray(module.apply({"params": merged}, tokens)[0])
    got = np.asarray(module.apply({"params": params}, tokens)[0])
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(want - np.asarray(module.apply({"params": base}, tokens)[0])).max() > 1e-2
    cache = policy.init_cache(cfg, 2, 16, jnp.float32)
    first, cache = module.apply({"params": params}, tokens[:, :5], None, cache)
    rest, _ = module.apply({"params": params}, tokens[:, 5:], None, cache)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), want, atol=2e-5)


def projected(dw: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float):
    """(dL/dA, dL/dB) from the full weight's gradient dL/dW [L, *In, *Out] through
    W + scale A B: dA = scale dW B^T, dB = scale A^T dW, per layer."""
    n_l, r = a.shape[0], a.shape[-1]
    dw2, a2, b2 = dw.reshape(n_l, a[0].size // r, -1), a.reshape(n_l, -1, r), b.reshape(n_l, r, -1)
    da = scale * np.einsum("lio,lro->lir", dw2, b2)
    db = scale * np.einsum("lir,lio->lro", a2, dw2)
    return da.reshape(a.shape), db.reshape(b.shape)


def _batch():
    host = host_batch(make_trajs(n=4, group=2, seed=3), 0)
    batch = micro_batches(to_device(host), micro_plan(host.prompt_of, np.arange(4), 4, share=False))
    return {k: v[0] for k, v in batch.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("path", ["scan", "full", "xla_cpu_loop"])
def test_adapter_gradients_are_projected_weight_gradients(family, path):
    """dL/dA = (alpha/r) dL/dW B^T and dL/dB = (alpha/r) A^T dL/dW for all seven targets,
    dL/dW taken by autodiff of the base model at W + (alpha/r) A B. Paths: the train
    forward over the stacked layers (`lax.scan`), the full forward (the decoder's `nn.scan`),
    and the CPU policy's per-layer Python loop over split params (its bf16 train steps)."""
    cfg = FAMILIES[family]
    base, adapters = random_params(cfg, seed=4)
    scale = cfg.lora.scale
    policy = XLA_CPU if path == "xla_cpu_loop" else PLAIN
    module = Decoder(cfg, policy=policy)
    batch = _batch()
    w = jnp.asarray(np.random.default_rng(5).normal(size=batch["tokens"].shape), jnp.float32) * batch["valid"]
    tokens = jnp.concatenate([batch["prompt"], batch["tokens"]], axis=1)  # a prompt per row (u == b)
    valid = jnp.concatenate([batch["prompt_valid"], batch["valid"]], axis=1)

    def loss(params):
        if path == "full":
            logp, ent = token_logprobs(module, params, tokens, valid)
            return (logp[:, -w.shape[1]:] * w).sum() + 0.3 * (ent[:, -w.shape[1]:] * w).sum()
        logp, ent = micro_logprobs(module, params, batch)
        return (logp * w).sum() + 0.3 * (ent * w).sum()

    if path == "xla_cpu_loop":
        g_lora = jax.jit(jax.grad(lambda ad: loss(lora.join(unstack_layers(base), ad))))(unstack_layers(adapters))
        g_lora = stack_layers(g_lora)
    else:
        g_lora = jax.jit(jax.grad(lambda ad: loss(lora.join(base, ad))))(adapters)
    merged = lora.merge_lora(lora.join(base, adapters), cfg)
    g_w = shd.flatten_params(jax.jit(jax.grad(loss))(merged))
    got, flat = shd.flatten_params(g_lora), shd.flatten_params(adapters)
    assert sorted(got) == sorted(flat)
    for target, weight in LORA_TARGETS.items():
        a, b = np.asarray(flat[weight + "_lora_a"]), np.asarray(flat[weight + "_lora_b"])
        da, db = projected(np.asarray(g_w[weight], np.float64), a, b, scale)
        for name, want in ((weight + "_lora_a", da), (weight + "_lora_b", db)):
            have = np.asarray(got[name])
            assert np.abs(want).max() > 1e-3, name  # a real gradient, not two zeros
            np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=name)
