"""Blockwise (flash) attention equals the dense one: values and gradients w.r.t. q, k, v
in float32, with GQA (K = 2, G = 3), causal slot masks with left / right padding, holes
and a fully padded row, a chunk at a cache offset, blocks that do not divide T or S, and
responses over a shared prompt's keys; the model's train-step log-probs and gradients
are the same numbers with blockwise attention forced by the policy; the policies pick
dense attention for decode steps and short chunks (on the CPU, up to longer ones)."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.models import flash
from car_jax.models.cache import LayerKV
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.layers import Block
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.rl import grpo
from car_jax.rl.logprobs import Prompts, response_logprobs
from car_jax.rl.steps import grads_and_metrics
from tests.test_policy import V, _batch

B, K, G, H = 4, 2, 3, 8


def _close(got, want):
    """fp32, 1e-5 relative to the larger of 1 and the reference's magnitude (a gradient
    sums S products of values up to ~10: its absolute rounding grows with that scale)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * max(1.0, float(np.abs(want).max())), err


def _key_ok(s: int, rng) -> np.ndarray:
    """bool[B, S]: a left-padded row, a right-padded one, one with random holes, and a
    fully padded one (each query then sees only its own slot)."""
    ok = np.ones((B, s), bool)
    ok[0, :3] = False
    ok[1, s - 4:] = False
    ok[2] = rng.random(s) > 0.4
    ok[3] = False
    return ok


def _qkv(t: int, s: int, rng):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return normal(B, t, K, G, H), normal(B, s, K, H), normal(B, s, K, H), normal(B, t, K, G, H)


def _numpy_attention(q, k, v, key_ok, offset):
    """The definition, row by row: query t sees the valid keys s <= offset + t and its own slot."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            seen = [s for s in range(k.shape[1]) if (key_ok[b, s] and s <= offset + t) or s == offset + t]
            for kh in range(K):
                sc = q[b, t, kh] @ k[b, seen, kh].T  # [G, seen]
                p = np.exp(sc - sc.max(axis=-1, keepdims=True))
                out[b, t, kh] = (p / p.sum(axis=-1, keepdims=True)) @ v[b, seen, kh]
    return out


# (T, S, offset, block_q, block_k): self-attention over a sequence, blocks that divide
# neither T nor S; a chunk written at slot 5 of a 20-slot cache; blocks larger than T.
CASES = {"causal": (13, 13, 0, 4, 3), "cache_offset": (9, 20, 5, 4, 6), "one_block": (6, 10, 2, 16, 16)}


def _out_and_grads(attend, ct, *args):
    """attend(*args) and the gradients of sum(attend(*args) * ct) w.r.t. every argument, jitted."""
    def f(*args):
        out, vjp = jax.vjp(attend, *args)
        return out, vjp(ct)
    return jax.jit(f)(*args)


def _check(got, want):
    (out, grads), (want_out, want_grads) = got, want
    _close(out, want_out)
    for g, w in zip(grads, want_grads):
        _close(g, w)
        assert float(np.abs(np.asarray(w)).max()) > 1e-2  # a gradient that is there


@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_dense_values_and_gradients(case):
    t, s, offset, bq, bk = CASES[case]
    rng = np.random.default_rng(len(case))
    q, k, v, ct = _qkv(t, s, rng)
    key_ok = _key_ok(s, rng)
    mask = flash.slot_mask(jnp.asarray(key_ok), offset, t)
    want = _out_and_grads(lambda q, k, v: flash.dense_attention(q, k, v, mask), ct, q, k, v)
    _close(want[0], _numpy_attention(q, k, v, key_ok, offset))  # the dense one is the definition
    blockwise = lambda q, k, v: flash.blockwise_attention(q, k, v, jnp.asarray(key_ok), offset, bq, bk)  # noqa: E731
    _check(_out_and_grads(blockwise, ct, q, k, v), want)


def test_responses_over_a_shared_prompt():
    """U = 2 prompts (left-padded, P = 7) read by B = 4 rows (prompt_index), each row's
    response (right-padded, R = 10) after its prompt: keys = the prompt's then its own,
    offset P. Gradients w.r.t. the prompts' keys and values sum over the rows that read them."""
    rng = np.random.default_rng(7)
    p, r, index = 7, 10, jnp.asarray([0, 0, 1, 1])
    prompt_ok = jnp.asarray(np.arange(p)[None] >= np.array([[2], [0]]))  # [U, P]
    valid = jnp.asarray(np.arange(r)[None] < np.array([[10], [4], [1], [7]]))  # [B, R]
    key_ok = jnp.concatenate([prompt_ok[index], valid], axis=1)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, kp, vp, kr, vr, ct = normal(B, r, K, G, H), normal(2, p, K, H), normal(2, p, K, H), \
        normal(B, r, K, H), normal(B, r, K, H), normal(B, r, K, G, H)

    def after_prompt(attend):
        def f(q, kp, vp, kr, vr):
            k = jnp.concatenate([kp[index], kr], axis=1)  # [B, P + R, K, H]
            v = jnp.concatenate([vp[index], vr], axis=1)
            return attend(q, k, v)
        return f

    mask = flash.slot_mask(key_ok, p, r)
    args = (q, kp, vp, kr, vr)
    want = _out_and_grads(after_prompt(lambda q, k, v: flash.dense_attention(q, k, v, mask)), ct, *args)
    _check(_out_and_grads(after_prompt(lambda q, k, v: flash.blockwise_attention(q, k, v, key_ok, p, 4, 5)), ct,
                          *args), want)
    assert float(np.abs(np.asarray(want[1][1])[0, :2]).max()) == 0.0  # prompt 0's two pad slots: never read


def test_a_slot_mask_is_its_last_row():
    """What `Blockwise` reads of the layer's dense mask: its last row gives the same mask back."""
    rng = np.random.default_rng(3)
    for t, s, offset in ((13, 13, 0), (5, 20, 9), (1, 8, 7)):
        key_ok = jnp.asarray(rng.random((B, s)) > 0.5)
        mask = flash.slot_mask(key_ok, offset, t)
        np.testing.assert_array_equal(np.asarray(flash.slot_mask(mask[:, -1], offset, t)), np.asarray(mask))


def test_the_policies_choose_the_attention():
    assert PLAIN.attention.handles(1024, 1024) and PLAIN.attention.handles(512, 4096)
    assert not PLAIN.attention.handles(512, 1024)  # short: dense
    assert not PLAIN.attention.handles(1, 1 << 20)  # a decode step: the cache matmuls, always
    assert not XLA_CPU.attention.handles(1024, 2048) and XLA_CPU.attention.handles(2048, 2048)  # the CPU: later
    assert not XLA_CPU.attention.handles(1, 1 << 24)
    assert not flash.Blockwise(min_scores=0).handles(1, 64)


def test_fused_wiring_equals_dense():
    """`flash.Fused` hands q, k, v and the mask to jax.nn.dot_product_attention as cuDNN
    would get them; XLA's implementation of it (CPU) checks head grouping and mask."""
    rng = np.random.default_rng(5)
    q, k, v, _ = _qkv(9, 20, rng)
    mask = flash.slot_mask(jnp.asarray(_key_ok(20, rng)), 5, 9)
    _close(flash.Fused("xla")(q, k, v, mask, 5), flash.dense_attention(q, k, v, mask))


CFG = ModelConfig("qwen2", vocab_size=V, d_model=48, n_layers=2, n_heads=K * G, n_kv_heads=K, head_dim=H,
                  mlp_dim=64, qkv_bias=True)
DENSE_POLICY = dataclasses.replace(PLAIN, name="dense", attention=flash.DENSE)
BLOCKWISE_POLICY = dataclasses.replace(PLAIN, name="blockwise", attention=flash.Blockwise(4, 3, min_scores=0))


@pytest.fixture(scope="module")
def params():
    """Random params of the model's shapes (numpy: nothing to compile), norm scales near 1."""
    shapes = jax.eval_shape(Decoder(CFG).init, jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
    rng = np.random.default_rng(1)

    def draw(path, a):
        scale = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(scale + 0.1 * rng.normal(size=a.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def test_a_layer_equals_with_either_attention(params):
    """One layer, both branches of `Attention`: a whole sequence (no cache) and a chunk
    written into a cache at a traced index, left-padded rows and holes in the cache."""
    rng = np.random.default_rng(2)
    layer = jax.tree.map(lambda a: a[0], params["layers"])
    x = jnp.asarray(rng.normal(size=(B, 11, CFG.d_model)), jnp.float32)
    valid = jnp.asarray(_key_ok(11, rng))
    pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    cache = LayerKV(jnp.asarray(rng.normal(size=(B, K, H, 24)), jnp.float32),
                    jnp.asarray(rng.normal(size=(B, K, 24, H)), jnp.float32))
    index = jnp.asarray(6, jnp.int32)
    cache_ok = jnp.asarray(rng.random((B, 24)) > 0.3).at[:, 6:17].set(valid)

    def run(attention):
        block = Block(CFG, jnp.float32, jnp.float32, attention=attention)
        apply = jax.jit(lambda x: block.apply({"params": layer}, x, pos, flash.slot_mask(valid, 0, 11), None, None)[0])
        cached = jax.jit(lambda x, i: block.apply({"params": layer}, x, pos + 3, flash.slot_mask(cache_ok, i, 11),
                                                  cache, i)[0])  # the index traced, as in prefill
        return apply(x), cached(x, index)

    for got, want in zip(run(flash.Blockwise(4, 5)), run(flash.DENSE)):
        _close(got, want)


def test_train_step_equals_with_blockwise_attention(params):
    """The GRPO train step (prompt-sharing forward, left-padded prompts, right-padded
    responses, blocks that divide neither P = 8 nor P + R = 20): the responses' log-probs,
    loss, metrics and every gradient as with dense attention."""
    batch = _batch()
    prompts = Prompts(*(batch[k][0] for k in ("prompt", "prompt_valid", "prompt_index")))
    micro = (prompts, batch["tokens"][0], batch["valid"][0])
    loss_cfg = grpo.LossConfig(kl_coef=0.01, entropy_coef=0.01)

    @partial(jax.jit, static_argnums=0)
    def step(module, params, batch):
        return response_logprobs(module, params, *micro)[0], grads_and_metrics(module, loss_cfg, params, batch)

    (logp1, (g1, m1, l1)), (logp2, (g2, m2, l2)) = (step(Decoder(CFG, policy=p), params, batch)
                                                    for p in (BLOCKWISE_POLICY, DENSE_POLICY))
    _close(logp1, logp2)
    _close(l1, l2)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        _close(a, b)
    assert max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(g2)) > 1e-3
    for k in m1:
        _close(m1[k], m2[k])


RAN = []  # the T of every chunk a `Recording` variant ran, appended at trace time


@dataclasses.dataclass(frozen=True)
class Recording(flash.Blockwise):
    """`flash.Blockwise` that notes each chunk it runs: proof the policy's variant is wired."""

    def __call__(self, q, k, v, mask, offset):
        RAN.append(q.shape[1])
        return super().__call__(q, k, v, mask, offset)


@pytest.mark.parametrize("base", [PLAIN, XLA_CPU], ids=lambda p: p.name)
def test_decoder_forward_and_prefill_equal_with_blockwise_attention(params, base):
    """`Decoder.__call__` under each layer layout: the full forward (left-padded rows and
    holes) and a cached prefill of 11 tokens, a second chunk of 5 at a traced index and
    one decode step give the same logits and cache with blockwise attention forced (blocks
    dividing neither T nor S) as with dense; the blockwise variant runs for the forward
    and both chunks, not for the decode step."""
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, V, (B, 16)), jnp.int32)
    valid = jnp.asarray(_key_ok(16, rng)).at[3].set(True)  # every row some valid token: logits to compare

    def run(attention):
        module = Decoder(CFG, policy=dataclasses.replace(base, attention=attention))
        apply = jax.jit(lambda *a: module.apply({"params": params}, *a))
        full, _ = apply(tokens, valid)
        cache = module.policy.init_cache(CFG, B, 24, jnp.float32)
        first, cache = apply(tokens[:, :11], valid[:, :11], cache)
        second, cache = apply(tokens[:, 11:], valid[:, 11:], cache)
        step, cache = apply(tokens[:, :1], jnp.ones((B, 1), bool), cache)
        return full, first, second, step, cache

    RAN.clear()
    got = run(Recording(4, 5, min_scores=0))
    assert sorted(set(RAN)) == [5, 11, 16], RAN  # traced once per layer scan, or once per layer
    want = run(flash.DENSE)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if a.dtype == bool:  # the cache's valid slots
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            _close(a, b)
