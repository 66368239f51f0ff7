"""Incremental decode through the KV cache equals the full forward, with left padding,
under both execution policies (the plain stacked cache and XLA:CPU's per-layer one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import car_jax
from car_jax.models.policy import PLAIN, XLA_CPU
from tests.hf_factory import build

POLICIES = pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)


def leaves(cache):
    """The cache's keys and values as one list of arrays, whatever the layout."""
    return jax.tree.leaves((cache.k, cache.v))


def full_logits(model, seqs, width: int = 12) -> np.ndarray:
    """float32[B, width, V]: each row's causal logits from position 0, no cache, the rows
    right-padded in one batch (a causal row's logits do not depend on what follows it)."""
    tokens = np.zeros((len(seqs), width), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    return np.asarray(model.logits(tokens))


@POLICIES
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama"])
def test_prefill_then_decode_equals_full_forward(name, policy, tmp_path):
    build(name, tmp_path)
    model = car_jax.load_model(tmp_path, policy=policy)
    rng = np.random.default_rng(0)
    lengths = [12, 7, 10]  # rows of different lengths, left padded to 12
    seqs = [rng.integers(0, 96, size=n) for n in lengths]
    width = max(lengths)
    tokens = np.zeros((3, width), np.int32)
    valid = np.zeros((3, width), bool)
    for b, s in enumerate(seqs):
        tokens[b, width - len(s):] = s
        valid[b, width - len(s):] = True

    k = 5  # prefill the first k columns, then one column per step (the chunk shapes the tests below reuse)
    cache = model.init_cache(3, 16)
    logits, cache = model.forward(jnp.asarray(tokens[:, :k]), jnp.asarray(valid[:, :k]), cache)
    steps = [np.asarray(logits)]
    for t in range(k, width):
        logits, cache = model.forward(jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(valid[:, t:t + 1]), cache)
        steps.append(np.asarray(logits))
    cached = np.concatenate(steps, axis=1)  # [B, width, V]

    assert int(cache.index) == width
    np.testing.assert_array_equal(np.asarray(cache.next_pos), lengths)
    full = full_logits(model, seqs)
    for b, s in enumerate(seqs):
        got = cached[b, width - len(s):]
        assert np.abs(got - full[b, :len(s)]).max() <= 1e-5


@POLICIES
def test_holes_in_the_cache_do_not_shift_positions(policy, tmp_path):
    """A chunk where rows have fewer real tokens (an observation shorter than the chunk)
    leaves invalid slots, after, before or between a row's tokens; the rows' later tokens
    see the same logits as without. The chunks are [3, 5] into a [3, 16] cache and the
    reference a [3, 12] forward: the programs of the qwen2 case above."""
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path, policy=policy)
    rng = np.random.default_rng(1)
    a, b, c = rng.integers(0, 96, size=(3, 5)), rng.integers(0, 96, size=(3, 5)), rng.integers(0, 96, size=(3, 5))
    holes = np.array([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1], [1, 0, 1, 0, 0]], bool)  # 2 real tokens a row, 3 pad slots
    cache = model.init_cache(3, 16)
    every = jnp.ones((3, 5), bool)  # (not None: the same program as the masked chunk)
    _, cache = model.forward(jnp.asarray(a), every, cache)
    _, cache = model.forward(jnp.asarray(np.where(holes, b, 0)), jnp.asarray(holes), cache)
    logits, cache = model.forward(jnp.asarray(c), every, cache)
    full = full_logits(model, [np.concatenate([a[r], b[r][holes[r]], c[r]]) for r in range(3)])
    np.testing.assert_array_equal(np.asarray(cache.next_pos), [12, 12, 12])
    assert np.abs(np.asarray(logits) - full[:, -5:]).max() <= 1e-5


def test_overflow_is_refused(tmp_path):
    build("llama", tmp_path)
    model = car_jax.load_model(tmp_path)
    cache = model.init_cache(1, 4)
    with pytest.raises(ValueError, match="capacity 4"):
        model.forward(jnp.zeros((1, 5), jnp.int32), None, cache)


# The decode tests' shapes: 3 rows, prompts left-padded to 16, a 200-slot cache, 60 sampled tokens
ROWS, PROMPT, CAPACITY, STEPS = 3, 16, 200, 60


@POLICIES
def test_shared_prompt_prefill_equals_a_prefill_per_row(policy, tmp_path):
    """A GRPO batch repeats each prompt G times: prefill_distinct runs the distinct ones and
    copies their cache rows. Logits, keys, values, valid slots and positions equal a
    prefill of every row, and decoding on from either cache gives the same tokens. The
    prefill of every row and the decode loop are the staged test's programs."""
    from car_jax.rollout.decode import DecodeLoop
    from car_jax.rollout.generate import left_pad
    from car_jax.rollout.prefill import prefill, prefill_distinct
    from car_jax.rollout.sampling import Sampler
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path, policy=policy)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 96, size=n)) for n in (5, 9)]
    inverse = np.array([1, 0, 1], np.int32)  # row -> its prompt: out of order, one repeated
    rows = [prompts[i] for i in inverse]
    tokens, valid = left_pad(rows, PROMPT, 0)
    want_logits, want = prefill(model.module, model.params, model.init_cache(ROWS, CAPACITY), jnp.asarray(tokens),
                                jnp.asarray(valid))
    tokens_u, valid_u = left_pad(prompts, PROMPT, 0)
    got_logits, got = prefill_distinct(model.module, params=model.params, cache=model.init_cache(ROWS, CAPACITY),
                                       tokens=jnp.asarray(tokens_u), valid=jnp.asarray(valid_u),
                                       inverse=jnp.asarray(inverse))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
    np.testing.assert_array_equal(np.asarray(got.next_pos), [len(r) for r in rows])
    assert int(got.index) == int(want.index) == PROMPT
    tables = jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)  # one automaton that never fires
    no_eos = jnp.asarray([-1], jnp.int32)
    loop = DecodeLoop(module=model.module, sampler=Sampler(1.0), max_steps=STEPS, windows=())  # as the staged test
    outs = [loop.segment(params=model.params, cache=c, logits=lg, live=jnp.ones(ROWS, bool), eos_ids=no_eos,
                         tables=tables, key=jax.random.key(0))[0]
            for c, lg in ((got, got_logits), (want, want_logits))]
    np.testing.assert_array_equal(np.asarray(outs[1].length), STEPS)
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(np.asarray(outs[0].logp), np.asarray(outs[1].logp), atol=1e-5)  # logits to 1e-5


@POLICIES
def test_staged_windowed_decode_equals_decode_over_the_whole_cache(policy, tmp_path):
    """DecodeLoop(windows=...) samples in stages over the first W_j slots only and
    writes them back: sampled tokens, their log-probs and the returned cache equal one
    decode over all S slots, over several stages (rows that stop early, and rows that take
    no part, included). The stages run every step a single window short of S runs (take
    the first slots, loop, write them back), and each stage more is one more compile."""
    from car_jax.rollout.decode import DecodeLoop
    from car_jax.rollout.generate import decode_windows, left_pad
    from car_jax.rollout.prefill import prefill
    from car_jax.rollout.sampling import Sampler
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path, policy=policy)
    rng = np.random.default_rng(3)
    tokens, valid = left_pad([list(rng.integers(0, 96, size=n)) for n in (7, 12, 3)], PROMPT, 0)
    capacity, steps = CAPACITY, STEPS
    staged = decode_windows(16, steps, capacity)
    assert staged == (64, 96)  # slots 17..64, then 65..76 (the 96 bucket), well short of 200
    # with this seed, under each policy's draw: row 0 stops in the first stage, row 1 does not
    eos = jnp.asarray([69 if policy is XLA_CPU else 14], jnp.int32)
    tables = jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)
    runs = []
    for windows in ((), staged):
        logits, cache = prefill(model.module, model.params, model.init_cache(ROWS, capacity), jnp.asarray(tokens),
                                jnp.asarray(valid))
        loop = DecodeLoop(module=model.module, sampler=Sampler(1.0), max_steps=steps, windows=windows)
        out, cache = loop.segment(params=model.params, cache=cache, logits=logits,
                                  live=jnp.asarray([True, True, False]), eos_ids=eos, tables=tables,
                                  key=jax.random.key(5))
        runs.append((out, cache))
    want, want_cache = runs[0]
    lengths = np.asarray(want.length)
    # row 0 stops in the first stage, row 1 runs through both, row 2 takes no part
    assert lengths[0] < 64 - 16 and bool(want.stopped[0])
    assert lengths[1] == steps and not bool(want.stopped[1]) and lengths[2] == 0
    for got, got_cache in runs[1:]:
        assert got_cache.capacity == capacity
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.length), lengths)
        np.testing.assert_array_equal(np.asarray(got.stopped), np.asarray(want.stopped))
        np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got_cache.valid), np.asarray(want_cache.valid))
        np.testing.assert_array_equal(np.asarray(got_cache.next_pos), np.asarray(want_cache.next_pos))
        assert int(got_cache.index) == int(want_cache.index)
        for a, b in zip(leaves(got_cache), leaves(want_cache), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_decode_refuses_windows_that_do_not_increase(tmp_path):
    from car_jax.rollout.decode import DecodeLoop
    from car_jax.rollout.sampling import Sampler
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path)
    cache = model.init_cache(1, 32)
    logits = jnp.zeros((1, model.config.vocab_size))
    tables = jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)
    for bad in ((16, 16), (16, 48)):
        with pytest.raises(ValueError, match="must increase and end at most at the capacity 32"):
            DecodeLoop(module=model.module, sampler=Sampler(), max_steps=4, windows=bad).segment(
                params=model.params, cache=cache, logits=logits, live=jnp.ones(1, bool),
                eos_ids=jnp.zeros((0,), jnp.int32), tables=tables, key=jax.random.key(0))


def test_decode_windows_bucket_stage_and_refuse_overflow():
    from car_jax.rollout.generate import decode_windows, length_bucket
    assert decode_windows(0, 64, 1000) == (64,)
    assert decode_windows(40, 60, 1000) == decode_windows(40, 60, 1000, stages=4)  # the CPU default
    assert decode_windows(40, 60, 1000) == (64, 96, 128)  # slots 41..100 pass the 64, 96 and 128 buckets
    assert decode_windows(40, 60, 1000, stages=1) == (128,)
    assert decode_windows(48, 128, 176) == (64, 96, 128, 176)  # the last one capped at the capacity
    assert decode_windows(900, 64, 1000) == (1000,)  # 901..964 all fall in the capped 1024 bucket
    # a long segment: only the last 4 of its buckets, so at most 4 loops compile
    windows = decode_windows(0, 4000, 5000)
    assert windows == (1536, 2048, 3072, 4096)
    assert all(length_bucket(w) == w for w in windows)
    with pytest.raises(ValueError, match="capacity 100"):
        decode_windows(50, 64, 100)
    with pytest.raises(ValueError, match="stages=0"):
        decode_windows(0, 8, 100, stages=0)
