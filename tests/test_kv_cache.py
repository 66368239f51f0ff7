"""Incremental decode through the KV cache equals the full forward, with left padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import car_jax
from tests.hf_factory import build


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama"])
def test_prefill_then_decode_equals_full_forward(name, tmp_path):
    build(name, tmp_path)
    model = car_jax.load_model(tmp_path)
    rng = np.random.default_rng(0)
    lengths = [12, 7, 10]  # rows of different lengths, left padded to 12
    seqs = [rng.integers(0, 96, size=n) for n in lengths]
    width = max(lengths)
    tokens = np.zeros((3, width), np.int32)
    valid = np.zeros((3, width), bool)
    for b, s in enumerate(seqs):
        tokens[b, width - len(s):] = s
        valid[b, width - len(s):] = True

    k = 5  # prefill the first k columns, then one column per step
    cache = model.init_cache(3, 16)
    logits, cache = model.forward(jnp.asarray(tokens[:, :k]), jnp.asarray(valid[:, :k]), cache)
    steps = [np.asarray(logits)]
    for t in range(k, width):
        logits, cache = model.forward(jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(valid[:, t:t + 1]), cache)
        steps.append(np.asarray(logits))
    cached = np.concatenate(steps, axis=1)  # [B, width, V]

    assert int(cache.index) == width
    np.testing.assert_array_equal(np.asarray(cache.next_pos), lengths)
    for b, s in enumerate(seqs):
        full = np.asarray(model.logits(s[None]))[0]  # the row alone, unpadded
        got = cached[b, width - len(s):]
        assert np.abs(got - full).max() <= 1e-5


def test_holes_in_the_cache_do_not_shift_positions(tmp_path):
    """A chunk where one row has fewer real tokens (an observation shorter than the
    chunk) leaves invalid slots; the row's later tokens see the same logits as without."""
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path)
    rng = np.random.default_rng(1)
    a, b, c = rng.integers(0, 96, size=4), rng.integers(0, 96, size=2), rng.integers(0, 96, size=3)
    cache = model.init_cache(1, 32)
    _, cache = model.forward(jnp.asarray(a[None]), None, cache)
    chunk = np.concatenate([b, [0, 0, 0]])[None]  # 2 real tokens, 3 pad slots
    _, cache = model.forward(jnp.asarray(chunk), jnp.asarray([[1, 1, 0, 0, 0]], bool), cache)
    logits, cache = model.forward(jnp.asarray(c[None]), None, cache)
    full = np.asarray(model.logits(np.concatenate([a, b, c])[None]))[0, -3:]
    assert np.abs(np.asarray(logits)[0] - full).max() <= 1e-5


def test_overflow_is_refused(tmp_path):
    build("llama", tmp_path)
    model = car_jax.load_model(tmp_path)
    cache = model.init_cache(1, 4)
    with pytest.raises(ValueError, match="capacity 4"):
        model.forward(jnp.zeros((1, 5), jnp.int32), None, cache)


def test_shared_prompt_prefill_equals_a_prefill_per_row(tmp_path):
    """A GRPO batch repeats each prompt G times: prefill_shared runs the distinct ones and
    copies their cache rows. Logits, keys, values, valid slots and positions equal a
    prefill of every row, and decoding on from either cache gives the same tokens."""
    from car_jax.rollout.decode import decode_segment, prefill, prefill_shared
    from car_jax.rollout.generate import left_pad
    from car_jax.rollout.sampling import Sampler
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 96, size=n)) for n in (5, 9, 3)]
    inverse = np.array([1, 0, 1, 2, 0, 1], np.int32)
    rows = [prompts[i] for i in inverse]
    tokens, valid = left_pad(rows, 16, 0)
    want_logits, want = prefill(model.module, model.params, model.init_cache(6, 24), jnp.asarray(tokens),
                                jnp.asarray(valid))
    tokens_u, valid_u = left_pad(prompts, 16, 0)
    got_logits, got = prefill_shared(model.module, model.params, model.init_cache(6, 24), jnp.asarray(tokens_u),
                                     jnp.asarray(valid_u), jnp.asarray(inverse))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5)
    for a, b in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
    np.testing.assert_array_equal(np.asarray(got.next_pos), [len(r) for r in rows])
    assert int(got.index) == int(want.index) == 16
    tables = jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)  # one automaton that never fires
    outs = [decode_segment(model.module, Sampler(), 8, model.params, c, lg, jnp.ones(6, bool),
                           jnp.zeros((0,), jnp.int32), tables, jax.random.key(0))[0]
            for c, lg in ((got, got_logits), (want, want_logits))]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))


def test_windowed_decode_equals_decode_over_the_whole_cache(tmp_path):
    """decode_segment(window=W) attends over the first W slots only and writes them back:
    sampled tokens, their log-probs and the returned cache equal a decode over all S."""
    from car_jax.rollout.decode import decode_segment, prefill
    from car_jax.rollout.generate import decode_window, left_pad
    from car_jax.rollout.sampling import Sampler
    build("qwen2", tmp_path)
    model = car_jax.load_model(tmp_path)
    rng = np.random.default_rng(3)
    tokens, valid = left_pad([list(rng.integers(0, 96, size=n)) for n in (7, 12, 3)], 16, 0)
    capacity, steps = 200, 20
    window = decode_window(16, steps, capacity)
    assert window == 64  # the smallest bucket that holds 16 + 20 slots, well short of 200
    tables = jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)
    runs = []
    for w in (0, window):
        logits, cache = prefill(model.module, model.params, model.init_cache(3, capacity), jnp.asarray(tokens),
                                jnp.asarray(valid))
        out, cache = decode_segment(model.module, Sampler(1.0), steps, model.params, cache, logits,
                                    jnp.asarray([True, True, False]), jnp.zeros((0,), jnp.int32), tables,
                                    jax.random.key(5), window=w)
        runs.append((out, cache))
    (want, want_cache), (got, got_cache) = runs
    assert got_cache.capacity == capacity
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache.valid), np.asarray(want_cache.valid))
    np.testing.assert_array_equal(np.asarray(got_cache.next_pos), np.asarray(want_cache.next_pos))
    assert int(got_cache.index) == int(want_cache.index) == 16 + steps
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_decode_window_buckets_and_refuses_overflow():
    from car_jax.rollout.generate import decode_window
    assert decode_window(0, 64, 1000) == 64
    assert decode_window(40, 60, 1000) == 128  # 100 slots: the 128 bucket (96 is too small)
    assert decode_window(900, 64, 1000) == 1000  # capped at the capacity
    with pytest.raises(ValueError, match="capacity 100"):
        decode_window(50, 64, 100)
