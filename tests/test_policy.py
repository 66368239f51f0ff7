"""The execution policies compute the same numbers: the plain (accelerator) path and the
XLA:CPU one agree on logits, greedy cached decode (tokens, log-probs, cache contents),
log-probs and train-step gradients, on tiny random models; each XLA:CPU kernel equals
the plain op it replaces.

Two layers: the XLA:CPU policy unrolls them (its compiles grow with depth), and two already
show a layer loop, per-layer weights and caches, and their order."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import car_jax
from car_jax.models import xla_cpu
from car_jax.loading import Model
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN, XLA_CPU, backend_policy, plain_tied_unembed
from car_jax.rl import grpo
from car_jax.rl.logprobs import Prompts, response_logprobs
from car_jax.rl.steps import grads_and_metrics
from car_jax.rollout.decode import DecodeLoop
from car_jax.rollout.generate import left_pad
from car_jax.rollout.prefill import prefill
from car_jax.rollout.sampling import Sampler
from tests.hf_factory import build

V = 96


def cfg_of(tied: bool) -> ModelConfig:
    return ModelConfig("qwen2", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       mlp_dim=64, qkv_bias=not tied, tie_embeddings=tied)


@functools.lru_cache(maxsize=None)
def random_params(cfg: ModelConfig):
    """Random params in Decoder(cfg)'s tree: norm scales 1 + 0.05 N(0, 1), every other leaf
    (weights, biases) 0.05 N(0, 1), drawn with numpy (shapes from `jax.eval_shape`): no
    init program to compile. Built once per config."""
    shapes = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(("norm" in jax.tree_util.keystr(path)) + 0.05 * rng.normal(size=a.shape),
                                    a.dtype), shapes)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def pair(request):
    """(cfg, params, {policy name: Model}) over the same random params."""
    cfg = cfg_of(request.param)
    params = random_params(cfg)
    return cfg, params, {p.name: Model(cfg, params, Decoder(cfg, policy=p)) for p in (PLAIN, XLA_CPU)}


def test_the_policy_is_chosen_per_backend_and_held_by_the_module(tmp_path):
    assert backend_policy("cpu") is XLA_CPU
    assert backend_policy("gpu") is PLAIN and backend_policy("tpu") is PLAIN
    assert backend_policy() is (XLA_CPU if jax.default_backend() == "cpu" else PLAIN)
    cfg = cfg_of(True)
    assert Decoder(cfg).policy is PLAIN  # built directly: the plain path
    build("llama", tmp_path)
    assert car_jax.load_model(tmp_path).module.policy is backend_policy()
    assert car_jax.load_model(tmp_path, policy=PLAIN).module.policy is PLAIN
    # static and hashable: part of the jit cache key, and equal modules share programs
    assert hash(Decoder(cfg, policy=XLA_CPU)) == hash(Decoder(cfg, policy=XLA_CPU))
    assert Decoder(cfg, policy=PLAIN) != Decoder(cfg, policy=XLA_CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLAIN.decode_stages = 2
    assert (PLAIN.decode_stages, XLA_CPU.decode_stages) == (1, 4)
    assert PLAIN.cache_dtype(jnp.bfloat16) == jnp.bfloat16 and XLA_CPU.cache_dtype(jnp.bfloat16) == jnp.float32


def test_logits_agree(pair):
    """Tied: 39 rows take XLA:CPU's tied unembedding behind a barrier (<= 128 rows), 160 rows
    its plain einsum. An untied model has no such branch (its lm_head is the same einsum
    under both policies), so one shape covers it."""
    cfg, _, models = pair
    for rows in [(3, 13), (2, 80)] if cfg.tie_embeddings else [(2, 80)]:
        tokens = np.random.default_rng(0).integers(0, V, size=rows)
        got = np.asarray(models["plain"].logits(tokens))
        want = np.asarray(models["xla_cpu"].logits(tokens))
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), rows


def _greedy(model, prompts, steps=12, capacity=48):
    tokens, valid = left_pad(prompts, 16, 0)
    logits, cache = prefill(model.module, model.params, model.init_cache(len(prompts), capacity),
                            jnp.asarray(tokens), jnp.asarray(valid))
    tables = jnp.zeros((1, 1, V), jnp.int32)
    loop = DecodeLoop(module=model.module, sampler=Sampler(), max_steps=steps, windows=(32, capacity))
    out, cache = loop.segment(params=model.params, cache=cache, logits=logits, live=jnp.ones(len(prompts), bool),
                              eos_ids=jnp.zeros((0,), jnp.int32), tables=tables, key=jax.random.key(0))
    return out, cache


# The decode and log-prob parities on the tied model: the untied one adds no code that depends
# on the policy there (its lm_head is the same einsum under both, its q/k/v biases the same
# Block code in both layer layouts), while the tied one decodes through XLA:CPU's tied
# unembedding. The untied model keeps its logits parity and its train step (lm_head's gradient).
TIED_ONLY = pytest.mark.parametrize("pair", [True], ids=["tied"], indirect=True)


@TIED_ONLY
def test_greedy_cached_decode_agrees(pair):
    """Tokens, recorded log-probs and every slot of the cache (the stacked [L, ...] arrays
    against the stack of the per-layer ones)."""
    cfg, _, models = pair
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, V, size=n)) for n in (5, 16, 9, 1)]
    (a, cache_a), (b, cache_b) = (_greedy(models[name], prompts) for name in ("plain", "xla_cpu"))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert len(set(np.asarray(a.tokens).ravel().tolist())) > 3  # not a degenerate repeat
    np.testing.assert_allclose(np.asarray(a.logp), np.asarray(b.logp), atol=1e-5)
    assert np.asarray(cache_a.k).shape == (cfg.n_layers, 4, cfg.n_kv_heads, cfg.head_dim, 48)
    assert np.asarray(cache_a.v).shape == (cfg.n_layers, 4, cfg.n_kv_heads, 48, cfg.head_dim)
    assert isinstance(cache_b.k, tuple) and len(cache_b.k) == cfg.n_layers
    for stacked, per_layer in ((cache_a.k, cache_b.k), (cache_a.v, cache_b.v)):
        np.testing.assert_allclose(np.asarray(stacked), np.stack([np.asarray(x) for x in per_layer]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache_a.valid), np.asarray(cache_b.valid))
    np.testing.assert_array_equal(np.asarray(cache_a.next_pos), np.asarray(cache_b.next_pos))


def _batch(m=2, b=4, u=2, p=8, r=12, seed=1):
    """A train-step batch [M, b, ...]: rows 2i and 2i + 1 share prompt i (u prompts)."""
    rng = np.random.default_rng(seed)
    prompt_valid = np.arange(p)[None, None, :] >= rng.integers(0, 4, size=(m, u, 1))  # left-padded
    valid = np.arange(r)[None, None, :] < rng.integers(3, r + 1, size=(m, b, 1))  # right-padded
    return {"prompt": jnp.asarray(rng.integers(0, V, (m, u, p)), jnp.int32),
            "prompt_valid": jnp.asarray(prompt_valid),
            "prompt_index": jnp.asarray(np.tile(np.arange(b) * u // b, (m, 1)), jnp.int32),
            "tokens": jnp.asarray(rng.integers(0, V, (m, b, r)), jnp.int32),
            "valid": jnp.asarray(valid), "mask": jnp.asarray(valid, jnp.float32),
            "old_logp": jnp.asarray(rng.normal(-4.5, 0.3, (m, b, r)) * valid, jnp.float32),
            "ref_logp": jnp.asarray(rng.normal(-4.5, 0.3, (m, b, r)) * valid, jnp.float32),
            "advantages": jnp.asarray(rng.normal(size=(m, b)), jnp.float32)}


# Two of the four (tied, dtype) pairs: the dtype picks XLA:CPU's layer layout and transposes
# (bf16: the split-layer loop, real transposed copies; float32: the scan, a plain .T), the
# tiedness the unembedding (tied: the transposed embedding; untied: lm_head, and q/k/v biases),
# and the two meet in one place only: a tied bf16 model differentiates XLA:CPU's transposed copy
# of the embedding (`logprobs.unembedding`). Tied bf16 runs that and the bf16 layer paths,
# untied float32 the scan, lm_head and the biases; tied float32 (a plain .T of the embedding)
# and untied bf16 (the same split loop, with biases) run no code these two leave out.
@pytest.mark.parametrize("tied,dtype", [(True, "bfloat16"), (False, "float32")],
                         ids=["tied-bfloat16", "untied-float32"])
def test_train_step_gradients_agree(tied, dtype):
    """grads_and_metrics under each policy: the scan and plain ops against XLA:CPU's
    kernels (in bf16 its split-layer loop, explicit transposes and float32 prompt keys,
    hence 3% there: bf16 rounds at different places)."""
    cfg = cfg_of(tied)
    params = random_params(cfg)
    loss_cfg = grpo.LossConfig(kl_coef=0.01, entropy_coef=0.01)
    batch = _batch()
    fn = jax.jit(grads_and_metrics, static_argnums=(0, 1))
    out = {p.name: fn(Decoder(cfg, dtype=jnp.dtype(dtype), policy=p), loss_cfg, params, batch) for p in (PLAIN, XLA_CPU)}
    (g1, m1, l1), (g2, m2, l2) = out["plain"], out["xla_cpu"]
    rel = 1e-5 if dtype == "float32" else 3e-2
    assert abs(float(l1) - float(l2)) <= rel * max(1.0, abs(float(l2)))
    assert jax.tree.structure(g1) == jax.tree.structure(g2)  # both stacked
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=rel * max(float(np.abs(b).max()), 1e-3))
    assert max(float(np.abs(np.asarray(g, np.float32)).max()) for g in jax.tree.leaves(g1)) > 1e-3
    for k in m1:
        assert abs(float(m1[k]) - float(m2[k])) <= rel * max(1.0, abs(float(m2[k]))), k


@TIED_ONLY
def test_response_logprobs_agree(pair):
    cfg, params, _ = pair
    micro = {k: v[0] for k, v in _batch().items()}
    args = (Prompts(micro["prompt"], micro["prompt_valid"], micro["prompt_index"]), micro["tokens"], micro["valid"])
    fn = jax.jit(response_logprobs, static_argnums=0, static_argnames="temperature")  # as the steps run it
    got = [np.asarray(fn(Decoder(cfg, policy=p), params, *args, temperature=0.8)[0]) for p in (PLAIN, XLA_CPU)]
    np.testing.assert_allclose(got[0], got[1], atol=1e-5)


def test_xla_cpu_kernels_equal_the_plain_ops():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(7, 300)), jnp.float32)
    x = x.at[2, 17].set(x[2].max() + 1).at[2, 40].set(x[2].max() + 1)  # a tie: the first index wins
    np.testing.assert_array_equal(np.asarray(xla_cpu.first_argmax(x)), np.asarray(PLAIN.argmax(x)))
    assert int(xla_cpu.first_argmax(x)[2]) == 17
    e = jnp.exp(x)
    np.testing.assert_allclose(np.asarray(xla_cpu.dot_row_sum(e)), np.asarray(PLAIN.row_sum(e)), rtol=1e-6)
    embed = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
    for shape in ((3, 16), (2, 4, 16), (200, 16)):  # the barrier path (<= 128 rows) and the plain one
        h = jnp.asarray(rng.normal(size=shape), jnp.float32)
        got = jax.jit(xla_cpu.tied_unembed, static_argnums=2)(h, embed, jnp.float32)
        want = plain_tied_unembed(h, embed, jnp.float32)
        assert got.shape == (*shape[:-1], 50) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    cfg = cfg_of(True)
    params = random_params(cfg)
    split = jax.jit(xla_cpu.unstack_layers)(params)  # one program, not a slice per leaf shape
    assert len(split["layers"]) == cfg.n_layers
    for i, layer in enumerate(split["layers"]):  # layer i is slice i of every stacked leaf
        for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(params["layers"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])
    restacked = jax.jit(xla_cpu.stack_layers)(split)
    assert jax.tree.structure(restacked) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
