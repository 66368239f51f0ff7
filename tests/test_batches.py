"""The host/device boundary: trajectories -> HostBatch (numpy) -> `to_device` -> TrainBatch,
and what runs on the device after it (micro-batch gather, reference log-probs, rewards and
advantages), on one device and on the 8-device mesh."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import car_jax
from car_jax.calibration.rewards import OverlongConfig, RewardConfig, RewardInputs, overlong_fn, reward_fn
from car_jax.config import ConfigError, dump_config, load_config
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.rl import grpo
from car_jax.rl.batches import (
    TrainBatch,
    chunked_logprobs,
    make_scorer,
    micro_batches,
    to_device,
)
from car_jax.rl.host_batch import HostBatch, host_batch, micro_plan
from car_jax.rl.logprobs import token_logprobs
from car_jax.rl.steps import BATCH_KEYS, batch_shardings, make_logprob_fn
from car_jax.rollout.episode import Trajectory
from car_jax.train.config import TrainConfig

ROW_FIELDS = ("prompt_of", "tokens", "valid", "mask", "old_logp", "correct", "q", "format_ok", "group", "keep")


def make_host(n=8, group=2, seed=0, keep=None):
    """n trajectories, `group` per prompt (prompts of 2..5 tokens, responses of 1..8 with some
    observation tokens), with random reward inputs and string group ids."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 64, size=rng.integers(2, 6)) for _ in range(n // group)]
    trajs = []
    for i in range(n):
        r = int(rng.integers(1, 9))
        trajs.append(Trajectory(prompts[i // group], rng.integers(0, 64, size=r), rng.normal(-4, 0.2, size=r),
                                rng.uniform(size=r) < 0.85))
    inputs = RewardInputs(rng.uniform(size=n) < 0.5, rng.uniform(size=n).astype(np.float32), rng.uniform(size=n) < 0.8)
    return trajs, host_batch(trajs, 0, keep=keep, inputs=inputs, groups=[f"q{i // group}" for i in range(n)])


def test_host_batch_holds_the_trajectories():
    keep = np.array([True, True, False, True, True, True, True, True])
    trajs, host = make_host(keep=keep)
    assert host.rows == 8 and host.prompts.shape[0] == 4
    for i, t in enumerate(trajs):
        r = len(t.response_ids)
        np.testing.assert_array_equal(host.prompts[host.prompt_of[i]][host.prompts_valid[host.prompt_of[i]]],
                                      t.prompt_ids)
        np.testing.assert_array_equal(host.tokens[i, :r], t.response_ids)
        assert host.valid[i, :r].all() and not host.valid[i, r:].any()
        np.testing.assert_array_equal(host.old_logp[i, :r], t.logprobs)
        np.testing.assert_array_equal(host.mask[i, :r], t.loss_mask * keep[i])  # a dropped row leaves the loss
    np.testing.assert_array_equal(host.keep, keep)  # ... and its group's statistics (`make_scorer`)
    np.testing.assert_array_equal(host.group, np.repeat(np.arange(4), 2))
    for name in HostBatch.__dataclass_fields__:
        assert isinstance(getattr(host, name), np.ndarray), name


def test_trajectories_hold_numpy_arrays():
    t = Trajectory([3, 4])
    t.add([5, 6], [-1.0, -2.0])
    t.add([7], sampled=False)
    assert t.prompt_ids.dtype == np.int32 and t.response_ids.dtype == np.int32
    np.testing.assert_array_equal(t.response_ids, [5, 6, 7])
    np.testing.assert_array_equal(t.logprobs, np.array([-1.0, -2.0, 0.0], np.float32))
    np.testing.assert_array_equal(t.loss_mask, [True, True, False])
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory([1], [2, 3], [0.0], [True])


def _check_values(host: HostBatch, batch: TrainBatch):
    for name in HostBatch.__dataclass_fields__:
        got = getattr(batch, name)
        assert isinstance(got, jax.Array), name
        want = getattr(host, name)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    b, r = host.tokens.shape
    assert batch.ref_logp.shape == (b, r) and batch.advantages.shape == (b,)
    assert not np.asarray(batch.ref_logp).any() and not np.asarray(batch.advantages).any()
    np.testing.assert_array_equal(np.asarray(batch.sampler_logp), host.old_logp)  # the sampler's, kept


@pytest.mark.parametrize("fsdp,tp", [(8, 1), (4, 2)])
def test_to_device_on_the_mesh_keeps_values_and_splits_rows(fsdp, tp):
    _, host = make_host(n=8)
    mesh = car_jax.make_mesh(fsdp=fsdp, tp=tp)
    batch = to_device(host, mesh)
    _check_values(host, batch)
    for name in (*ROW_FIELDS, "sampler_logp", "ref_logp", "advantages"):
        x = getattr(batch, name)
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), x.ndim), name
        assert {s.data.shape[0] for s in x.addressable_shards} == {8 // fsdp}, name  # rows really split
    for name in ("prompts", "prompts_valid"):
        x = getattr(batch, name)
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P()), x.ndim), name


def test_to_device_without_a_mesh_commits_to_the_first_device():
    _, host = make_host()
    batch = to_device(host)
    _check_values(host, batch)
    for x in jax.tree.leaves(batch):
        assert x.committed and x.devices() == {jax.devices()[0]}


def test_to_device_refuses_rows_that_do_not_split():
    _, host = make_host(n=6)
    with pytest.raises(ValueError, match="6 rows cannot be split over mesh axis fsdp of size 4"):
        to_device(host, car_jax.make_mesh(fsdp=4, tp=2))


def _numpy_micro_batches(host: HostBatch, plan, extra: dict):
    """The train step's input computed on the host from the plan: the reference layout."""
    arrays = {**{k: getattr(host, k) for k in ("tokens", "valid", "mask", "old_logp")},
              "sampler_logp": host.old_logp, **extra}
    out = {k: v[plan.rows] for k, v in arrays.items()}
    spare = (plan.pick < 0)[..., None]
    out["prompt"] = np.where(spare, 0, host.prompts[np.maximum(plan.pick, 0)])
    out["prompt_valid"] = ~spare & host.prompts_valid[np.maximum(plan.pick, 0)]
    out["prompt_index"] = plan.index
    return out


@pytest.mark.parametrize("on_mesh", [False, True])
def test_micro_batches_are_gathered_on_the_device(on_mesh):
    _, host = make_host(n=16, group=4)
    mesh = car_jax.make_mesh(fsdp=4, tp=2) if on_mesh else None
    rng = np.random.default_rng(1)
    extra = {"ref_logp": rng.normal(size=host.tokens.shape).astype(np.float32),
             "old_logp": rng.normal(size=host.tokens.shape).astype(np.float32),  # as if recomputed
             "advantages": rng.normal(size=16).astype(np.float32)}
    batch = to_device(host, mesh).replace(**{k: jnp.asarray(v) for k, v in extra.items()})
    plan = micro_plan(host.prompt_of, rng.permutation(16)[:8], 4, share=not on_mesh)
    got = micro_batches(batch, plan, mesh)
    assert set(got) == set(BATCH_KEYS)
    if not on_mesh:
        assert got["prompt"].shape[1] < 4  # shared prompts: fewer slots than rows
    want = _numpy_micro_batches(host, plan, extra)
    shardings = batch_shardings(mesh) if on_mesh else None
    for k in BATCH_KEYS:
        assert got[k].dtype == want[k].dtype or (k == "prompt_index" and got[k].dtype == jnp.int32), k
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
        if shardings:
            assert got[k].sharding.is_equivalent_to(shardings[k], got[k].ndim), k


@pytest.mark.parametrize("std_norm", [True, False])
def test_scorer_computes_rewards_and_advantages_on_the_device(std_norm):
    _, host = make_host(n=8)
    cfg = RewardConfig(kind="mscr", b1=1.5, b2=0.5)
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    batch, rewards = make_scorer(reward_fn(cfg), std_norm, mesh)(to_device(host, mesh))
    # the host reference: the reward math written out, advantages over the string group ids
    c, q = host.correct.astype(np.float64), host.q.astype(np.float64)
    want_r = c * (1 + 1.5 * (1 - (1 - q) ** 2)) - (1 - c) * 0.5 * q**2 - 0.5 * (~host.format_ok)
    np.testing.assert_allclose(np.asarray(rewards), want_r, rtol=1e-6, atol=1e-6)
    ids = [f"q{i // 2}" for i in range(8)]
    want_a = grpo.group_advantages(want_r, np.array(ids, object), std_norm=std_norm)
    np.testing.assert_allclose(np.asarray(batch.advantages), want_a, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(batch.advantages)).max() > 0.1
    # the advantages stay on the device, split like the rows; the rest of the batch is untouched
    assert batch.advantages.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 1)
    np.testing.assert_array_equal(np.asarray(batch.tokens), host.tokens)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_scorer_leaves_dropped_rows_out_of_the_group_statistics(on_mesh):
    """Hand-worked, binary reward (r = c, minus 0.5 without the format): group q0 keeps
    rewards (1, 0, -0.5) and drops a 1 (a void trajectory): mean 1/6, sample std
    sqrt(((5/6)^2 + (1/6)^2 + (2/3)^2) / 2) = sqrt(21) / 6; group q1 keeps one row of four,
    a group of one (A = r, as verl's advantages of the batch without the dropped rows).
    Dropped rows get advantage 0. Their rewards still come back (for the metrics)."""
    keep = np.array([1, 1, 1, 0, 0, 1, 0, 0], bool)
    trajs, _ = make_host()
    inputs = RewardInputs(np.array([1, 0, 0, 1, 1, 1, 0, 1], bool), np.full(8, 0.5, np.float32),
                          np.array([1, 1, 0, 1, 1, 1, 1, 1], bool))
    host = host_batch(trajs, 0, keep=keep, inputs=inputs, groups=["q0"] * 4 + ["q1"] * 4)
    mesh = car_jax.make_mesh(fsdp=4, tp=2) if on_mesh else None
    batch, rewards = make_scorer(reward_fn(RewardConfig(kind="binary")), True, mesh)(to_device(host, mesh))
    np.testing.assert_allclose(np.asarray(rewards), [1, 0, -0.5, 1, 1, 1, 0, 1])
    s = np.sqrt(21) / 6
    want = [(5 / 6) / s, (-1 / 6) / s, (-2 / 3) / s, 0, 0, 1 / (1 + 1e-6), 0, 0]
    np.testing.assert_allclose(np.asarray(batch.advantages), want, rtol=1e-5, atol=1e-7)


def test_reference_logprobs_stay_on_the_device_in_row_order():
    """chunked_logprobs of the device batch, on one device and on the mesh: a device array
    (on the mesh in the rows' sharding) whose row i holds the log-probs of trajectory i's
    response, as the plain forward over its full sequence gives them. The plain forward
    runs jitted, once over all 8 sequences, each flush left and followed by zeros that
    causal attention keeps out of every earlier position (one compile, not one per length)."""
    cfg = ModelConfig("qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      mlp_dim=64, qkv_bias=True)
    module = Decoder(cfg)
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]  # one compile
    trajs, host = make_host(n=8)
    order = np.random.default_rng(2).permutation(8)  # the plan's rows need not be in row order
    fn = make_logprob_fn(module, 0.8)
    single = chunked_logprobs(fn, params, to_device(host), micro_plan(host.prompt_of, order, 4))
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    sharded = chunked_logprobs(fn, params, to_device(host, mesh), micro_plan(host.prompt_of, order, 4, share=False),
                               mesh)
    assert isinstance(sharded, jax.Array) and sharded.shape == host.tokens.shape
    assert sharded.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    seqs = [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajs]
    flush_left = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        flush_left[i, :len(seq)] = seq
    plain = jax.jit(lambda p, tokens: token_logprobs(module, p, tokens, temperature=0.8)[0])
    forward = np.asarray(plain(params, jnp.asarray(flush_left)))
    for i, t in enumerate(trajs):
        r = len(t.response_ids)
        want = forward[i, len(t.prompt_ids):len(t.prompt_ids) + r]
        np.testing.assert_allclose(np.asarray(single)[i, :r], want, atol=1e-5)
        np.testing.assert_allclose(np.asarray(sharded)[i, :r], want, atol=1e-5)


def test_group_index_numbers_any_hashable_in_order():
    np.testing.assert_array_equal(grpo.group_index(["b", "a", "b", ("t", 1), "a"]), [0, 1, 0, 2, 1])
    np.testing.assert_array_equal(grpo.group_index(np.array([7, 7, 3])), [0, 0, 1])


def test_loss_temperature_is_not_a_config_key():
    """The train step's temperature comes from the episode config only: rl.loss has no such key."""
    with pytest.raises(ConfigError, match=r"unknown key 'rl\.loss\.temperature'"):
        load_config(TrainConfig, None, ["rl.loss.temperature=0.7"])
    assert "temperature" not in dump_config(TrainConfig())["rl"]["loss"]
    cfg = load_config(TrainConfig, None, ["rollout.temperature=0.7"])
    assert cfg.rollout.sampler.temperature == 0.7 and cfg.rollout.logprob_temperature == 0.7
    assert dataclasses.replace(cfg.rollout, temperature=0.0).logprob_temperature == 1.0  # greedy: T = 1


def test_tis_needs_recomputed_old_logprobs():
    """rl.loss.tis_cap compares the trainer's old log-probs with the sampler's: a config
    error names both keys when they are not recomputed; a cap below 1 is refused."""
    with pytest.raises(ConfigError, match=r"rl\.loss\.tis_cap: 2\.0 needs rl\.recompute_old_logp=true"):
        load_config(TrainConfig, None, ["rl.loss.tis_cap=2.0"])
    with pytest.raises(ConfigError, match=r"rl\.loss\.tis_cap: 0\.5 must be >= 1"):
        load_config(TrainConfig, None, ["rl.loss.tis_cap=0.5", "rl.recompute_old_logp=true"])
    cfg = load_config(TrainConfig, None, ["rl.loss.tis_cap=2", "rl.recompute_old_logp=true"])
    assert cfg.rl.loss.tis_cap == 2.0 and load_config(TrainConfig, None, []).rl.loss.tis_cap is None
    assert "horizon" not in dump_config(TrainConfig())["rl"]["loss"]  # set from the episode config only


def test_scorer_adds_the_overlong_shaping_of_the_sampled_tokens():
    """DAPO's soft overlong penalty (`rewards.overlong_fn`) of each row's model-written
    tokens (its mask: not the observation tokens) is added before the advantages."""
    _, host = make_host(n=8)
    sampled = host.mask.sum(-1)
    assert len(set(sampled.tolist())) >= 4  # lengths on every branch of the ramp below
    top, buffer = int(sampled.max()) - 1, 3
    shaping = overlong_fn(OverlongConfig(buffer=buffer, max_tokens=top, factor=0.5), budget=1000)
    plain, r0 = make_scorer(reward_fn(RewardConfig(kind="brier")), True)(to_device(host, None))
    shaped, r1 = make_scorer(reward_fn(RewardConfig(kind="brier")), True, shaping=shaping)(to_device(host, None))
    want = [0.0 if n <= top - buffer else (-0.5 if n > top else 0.5 * (top - buffer - n) / buffer) for n in sampled]
    np.testing.assert_allclose(np.asarray(r1) - np.asarray(r0), want, atol=1e-6)
    assert min(want) == -0.5 and max(want) == 0.0 and any(-0.5 < w < 0 for w in want)
    want_a = grpo.group_advantages(np.asarray(r1), host.group)
    np.testing.assert_allclose(np.asarray(shaped.advantages), want_a, rtol=1e-5, atol=1e-5)
    assert overlong_fn(OverlongConfig(), budget=1000) is None  # buffer 0: off
