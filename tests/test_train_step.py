"""The train step: chunked log-probs, exact micro-batch accumulation, sharded == unsharded,
Dr.GRPO's constant horizon; and what `Trainer.update` feeds it: the recomputed old
log-probs (rl.recompute_old_logp), their mismatch with the sampler's, TIS."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import car_jax
from car_jax import sharding as shd
from car_jax.config import load_config
from car_jax.loading import Model
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.models.xla_cpu import stack_layers, unstack_layers
from car_jax.rl import grpo
from car_jax.rl.batches import chunked_logprobs, micro_batches, to_device
from car_jax.rl.host_batch import host_batch, micro_plan
from car_jax.rl.logprobs import token_logprobs
from car_jax.rl.steps import (
    BATCH_KEYS,
    OptimConfig,
    grads_and_metrics,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_sft_step,
    make_train_step,
    micro_logprobs,
    state_shardings,
)
from car_jax.rl.mismatch import mismatch_metrics
from car_jax.rollout.episode import Trajectory
from car_jax.train.config import TrainConfig
from car_jax.train.log import Timer
from car_jax.train.setup import Setup
from car_jax.train.trainer import Trainer

CFG = ModelConfig("qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qkv_bias=True)


@pytest.fixture(scope="module")
def tiny():
    module = Decoder(CFG)
    params = module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return module, params


def place(params, mesh):
    """params placed on `mesh` in the sharding table's train layout."""
    return jax.device_put(params, shd.params_shardings(params, mesh, "train"))


def make_trajs(n=8, group=2, seed=0):
    """n trajectories, `group` per prompt, with prompts of 2..5 tokens, responses of 1..8
    tokens (some positions observations: loss mask 0) and random sampler log-probs."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, size=rng.integers(2, 6))) for _ in range(n // group)]
    trajs = []
    for i in range(n):
        r = int(rng.integers(1, 9))
        trajs.append(Trajectory([int(x) for x in prompts[i // group]], [int(x) for x in rng.integers(0, 64, size=r)],
                                list(rng.normal(-4, 0.2, size=r)), [int(m) for m in rng.uniform(size=r) < 0.85]))
    return trajs


def make_device_batch(n=8, group=2, seed=0, mesh=None, sampler_gap=0.0):
    """(host batch, device batch) of make_trajs with random advantages and reference log-probs;
    with sampler_gap, sampler log-probs that differ from old_logp by N(0, sampler_gap)."""
    rng = np.random.default_rng(seed + 1)
    host = host_batch(make_trajs(n, group, seed), 0)
    adv = rng.normal(size=n).astype(np.float32)
    ref = np.where(host.valid, rng.normal(-4, 0.2, size=host.valid.shape), 0).astype(np.float32)
    batch = to_device(host, mesh)
    sampler = host.old_logp + np.where(host.valid, rng.normal(0, sampler_gap, size=host.valid.shape), 0)
    return host, batch.replace(advantages=jnp.asarray(adv), ref_logp=jnp.asarray(ref),
                               sampler_logp=jnp.asarray(sampler, jnp.float32))


def make_batch(n=8, micro=None, group=2, seed=0, share=True, mesh=None, sampler_gap=0.0):
    """A train-step batch of n rows in micro-batches of `micro` rows (default: one)."""
    host, batch = make_device_batch(n, group, seed, mesh, sampler_gap)
    return micro_batches(batch, micro_plan(host.prompt_of, np.arange(n), micro or n, share), mesh)


def full_sequences(trajs):
    """tokens / valid [N, T] of prompt + response, right-padded (the plain layout)."""
    t = max(len(x.prompt_ids) + len(x.response_ids) for x in trajs)
    tokens, valid = np.zeros((len(trajs), t), np.int32), np.zeros((len(trajs), t), bool)
    for i, x in enumerate(trajs):
        seq = np.concatenate([x.prompt_ids, x.response_ids])
        tokens[i, :len(seq)], valid[i, :len(seq)] = seq, True
    return jnp.asarray(tokens), jnp.asarray(valid)


@pytest.mark.parametrize("chunk", [1, 4, 5, 128])
def test_chunked_logprobs_equal_full_logits(tiny, chunk):
    module, params = tiny
    tokens, valid = full_sequences(make_trajs())
    fn = jax.jit(token_logprobs, static_argnums=0, static_argnames=("temperature", "chunk"))
    logp, ent = fn(module, params, tokens, valid, temperature=0.7, chunk=chunk)
    logits, _ = module.apply({"params": params}, tokens, valid)
    full = jax.nn.log_softmax(np.asarray(logits) / 0.7, axis=-1)
    tok = np.asarray(tokens)
    ref = np.take_along_axis(np.asarray(full)[:, :-1], tok[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:], ref, atol=1e-5)
    ref_ent = -(np.exp(full) * full).sum(-1)[:, :-1]
    np.testing.assert_allclose(np.asarray(ent)[:, 1:], ref_ent, atol=1e-4)
    assert (np.asarray(logp)[:, 0] == 0).all()


@pytest.mark.parametrize("shared", [True, False])
def test_response_logprobs_equal_the_full_sequence_forward(tiny, shared):
    """Prompts run once and responses attend to their keys (shared: 4 prompts for 8
    rows, gathered by index; positional: a copy per row) give the log-probs, entropies
    and gradients of the plain forward over each concatenated sequence, read from the
    full logits at the response positions."""
    module, params = tiny
    trajs = make_trajs()
    host = host_batch(trajs, 0)
    batch = micro_batches(to_device(host), micro_plan(host.prompt_of, np.arange(8), 8, share=shared))
    batch = {k: v[0] for k, v in batch.items()}
    assert batch["prompt"].shape[0] == (4 if shared else 8)
    tokens, valid = full_sequences(trajs)
    w = jnp.asarray(np.random.default_rng(5).normal(size=batch["tokens"].shape), jnp.float32) * batch["valid"]

    def ours(p):
        logp, ent = micro_logprobs(module, p, batch, temperature=0.7, chunk=3)
        return (w * logp).sum() + 0.5 * (w * ent).sum(), (logp, ent)

    def plain(p):  # the full logits of the plain forward, no chunking, no custom gradient
        logits, _ = module.apply({"params": p}, tokens, valid)
        full = jax.nn.log_softmax(logits / 0.7, axis=-1)[:, :-1]  # position t predicts t + 1
        logp = jnp.take_along_axis(full, tokens[:, 1:, None], axis=-1)[..., 0]
        ent = -(jnp.exp(full) * full).sum(-1)
        # response token r of row i sits at position len(prompt_i) + r
        starts = np.array([len(t.prompt_ids) for t in trajs])
        cols = starts[:, None] - 1 + np.arange(w.shape[1])[None]
        cols = np.minimum(cols, logp.shape[1] - 1)
        logp, ent = jnp.take_along_axis(logp, cols, 1) * batch["valid"], jnp.take_along_axis(ent, cols, 1) * batch["valid"]
        return (w * logp).sum() + 0.5 * (w * ent).sum(), (logp, ent)

    (l1, (lp1, e1)), g1 = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    (l2, (lp2, e2)), g2 = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    v = np.asarray(batch["valid"])
    np.testing.assert_allclose(np.asarray(lp1)[v], np.asarray(lp2)[v], atol=1e-5)
    np.testing.assert_allclose(np.asarray(e1)[v], np.asarray(e2)[v], atol=1e-5)
    assert abs(float(l1) - float(l2)) <= 1e-4
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g1)) > 1e-3


def test_micro_batches_layout():
    """Each row reads its own trajectory's prompt; shared micro-batches hold each prompt
    once; a mini-batch's rows are all there once; spare prompt slots are all padding."""
    trajs = make_trajs(n=12, group=3)
    host = host_batch(trajs, 0)
    device = to_device(host)
    rows = np.random.default_rng(0).permutation(12)
    for share, micro in [(True, 4), (True, 6), (True, 2), (False, 4)]:
        b = jax.tree.map(np.asarray, micro_batches(device, micro_plan(host.prompt_of, rows, micro, share)))
        m = len(b["tokens"])
        seen = []
        for i in range(m):
            for j in range(micro):
                p = b["prompt"][i, b["prompt_index"][i, j]][b["prompt_valid"][i, b["prompt_index"][i, j]]]
                r = b["tokens"][i, j][b["valid"][i, j]]
                match = [k for k, t in enumerate(trajs) if list(t.prompt_ids) == list(p) and list(t.response_ids) == list(r)]
                assert match, (share, micro, i, j)
                seen.append(match[0])
            if not share or b["prompt"].shape[1] == micro:
                np.testing.assert_array_equal(b["prompt_index"][i], np.arange(micro))
            else:
                used = set(b["prompt_index"][i])
                assert len(used) == len({tuple(b["prompt"][i, k]) for k in used})  # each prompt once
                assert not b["prompt_valid"][i, sorted(set(range(b["prompt"].shape[1])) - used)].any()
        assert sorted(seen) == list(range(12))
    # 3 rows per prompt in micro-batches of 6 rows: 2 prompts each
    assert micro_batches(device, micro_plan(host.prompt_of, rows, 6))["prompt"].shape[1] == 2


def test_chunked_logprobs_keep_the_row_order(tiny):
    module, params = tiny
    trajs = make_trajs()
    host = host_batch(trajs, 0)
    got = np.asarray(chunked_logprobs(make_logprob_fn(module, 1.0), params, to_device(host),
                                      micro_plan(host.prompt_of, np.arange(8), 2)))
    tokens, valid = full_sequences(trajs)
    want = np.asarray(token_logprobs(module, params, tokens, valid)[0])
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        np.testing.assert_allclose(got[i, :r], want[i, p:p + r], atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_gradient_equals_autodiff_of_log_softmax(dtype):
    """head_stats' closed-form backward against jax.grad through log_softmax and the
    entropy written out in float32, for both the hidden states and the unembedding. In
    bfloat16 the backward's products take bf16 operands (the logit gradient is rounded
    to 8 bits of mantissa), hence the 2% tolerance there; the reference sees the same
    rounded inputs."""
    from car_jax.rl.logprobs import head_stats
    rng = np.random.default_rng(3)
    n, d, v, temp = 6, 5, 11, 0.7
    h = jnp.asarray(rng.normal(size=(n, d)), dtype)
    w = jnp.asarray(rng.normal(size=(d, v)), dtype)
    y = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    a, b = jnp.asarray(rng.normal(size=n), jnp.float32), jnp.asarray(rng.normal(size=n), jnp.float32)

    def ours(h, w):
        logp, ent = head_stats(h, w, y, 1.0 / temp)
        return (a * logp + b * ent).sum()

    def plain(h, w):
        full = jax.nn.log_softmax((h.astype(jnp.float32) @ w.astype(jnp.float32)) / temp, axis=-1)
        logp = jnp.take_along_axis(full, y[:, None], axis=-1)[:, 0]
        ent = -(jnp.exp(full) * full).sum(-1)
        return (a * logp + b * ent).sum()

    rel = 1e-5 if dtype == "float32" else 2e-2
    assert abs(float(ours(h, w)) - float(plain(h, w))) <= 1e-5 * max(1.0, abs(float(plain(h, w))))
    for got, want in zip(jax.grad(ours, argnums=(0, 1))(h, w), jax.grad(plain, argnums=(0, 1))(h, w)):
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        assert scale > 1e-3
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=rel * scale)


HORIZON = 300.0  # Dr.GRPO's horizon in the accumulation tests


def accumulation_cfg(agg):
    """The loss of the accumulation tests (one config each, so the width-16 step compiles once);
    "gspo": GSPO's sequence ratio (`rl.loss.ratio=sequence`) through the fused head."""
    if agg == "gspo":
        return grpo.LossConfig(agg="seq-mean-token-mean", ratio="sequence", kl_coef=0.01, entropy_coef=0.01)
    return grpo.LossConfig(agg=agg, kl_coef=0.01, entropy_coef=0.01, dual_clip=3.0)


# grads_and_metrics jitted as the train step runs it: module, loss config, temperature and horizon static
accumulated = jax.jit(grads_and_metrics, static_argnums=(0, 1), static_argnames=("temperature", "horizon"))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "gspo"])
def test_micro_batch_accumulation_is_exact(tiny, agg):
    module, params = tiny
    cfg = accumulation_cfg(agg)
    g1, m1, l1 = accumulated(module, cfg, params, make_batch(micro=8), horizon=HORIZON)
    g4, m4, l4 = accumulated(module, cfg, params, make_batch(micro=2), horizon=HORIZON)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g1, g4)
    assert max(jax.tree.leaves(diff)) <= 1e-5
    assert abs(float(l1) - float(l4)) <= 1e-6
    for k in m1:
        assert abs(float(m1[k]) - float(m4[k])) <= 1e-5, k
    # and the gradient is not trivially zero
    assert max(jax.tree.leaves(jax.tree.map(lambda a: float(jnp.abs(a).max()), g1))) > 1e-4


def test_dr_grpo_horizon_is_the_configured_constant(tiny):
    """seq-mean-token-sum-norm divides by the horizon (the builder's argument, from the episode
    config), not by the batch's padded width (16 here): with old_logp = the policy's own
    log-probs (ratio 1, no clip) each sampled token's policy term is -A, so pg_loss is the
    hand-computed -sum_b A_b n_b / horizon (n_b: row b's sampled tokens). The same loss at
    any padded width: `test_head_loss`."""
    module, params = tiny
    cfg = accumulation_cfg("seq-mean-token-sum-norm")  # the accumulation test's: compiled once
    host, batch = make_device_batch()
    assert batch.tokens.shape[1] == 16 != HORIZON
    old = chunked_logprobs(make_logprob_fn(module, 1.0), params, batch, micro_plan(host.prompt_of, np.arange(8), 2))
    plan = micro_plan(host.prompt_of, np.arange(8), 8)
    _, m, _ = accumulated(module, cfg, params, micro_batches(batch.replace(old_logp=old), plan), horizon=HORIZON)
    want = -(np.asarray(batch.advantages, np.float64) * host.mask.sum(1)).sum() / HORIZON
    assert abs(float(m["pg_loss"]) - want) <= 1e-5 * abs(want) and abs(want) > 1e-3
    # the builder needs the horizon: without it, Dr.GRPO's step is refused before it compiles
    with pytest.raises(ValueError, match="max_response_length"):
        make_train_step(module, make_optimizer(OptimConfig()), grpo.LossConfig(agg="seq-mean-token-sum-norm"),
                        temperature=1.0)
    # and takes only a positive horizon and temperature (the episode config's)
    with pytest.raises(ValueError, match="horizon=0"):
        make_train_step(module, make_optimizer(OptimConfig()), cfg, temperature=1.0, horizon=0)
    with pytest.raises(ValueError, match="temperature=0"):
        make_train_step(module, make_optimizer(OptimConfig()), cfg, temperature=0.0, horizon=HORIZON)


# the loss and optimizer of the sharded-step test, whose unsharded step `Trainer.update`'s test
# reuses (one compile for both): KL and truncated importance sampling on
STEP_LOSS = grpo.LossConfig(kl_coef=0.001, tis_cap=1.5)
STEP_OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=10)


def test_sharded_step_equals_unsharded(tiny):
    module, params = tiny
    cfg = STEP_LOSS
    opt = make_optimizer(STEP_OPTIM)

    plain = make_train_step(module, opt, cfg, temperature=1.0)  # one device: 2 micro-batches of 4 rows sharing 2 prompts
    batch = make_batch(micro=4, sampler_gap=0.5)  # TIS weights on both sides of the cap
    w = np.exp(np.asarray(batch["old_logp"] - batch["sampler_logp"]))[np.asarray(batch["mask"]) > 0]
    assert (w > cfg.tis_cap).any() and (w < cfg.tis_cap).any()
    s1, m1 = plain(init_state(jax.tree.map(jnp.copy, params), opt), batch)  # donates its state

    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    sharded_params = place(jax.tree.map(jnp.copy, params), mesh)
    state = init_state(sharded_params, opt, mesh)
    state_sh = state_shardings(state)
    step = make_train_step(module, opt, cfg, mesh, state_sh, temperature=1.0)
    # a prompt per row, rows over fsdp
    s2, m2 = step(state, make_batch(micro=4, share=False, mesh=mesh, sampler_gap=0.5))
    for path, x in shd.flatten_params(s2.params).items():
        assert x.sharding.is_equivalent_to(shd.param_sharding(path, x.shape, mesh), x.ndim)
    # compared on the host: s1 lives on one device, s2 on the mesh
    diff = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), s1.params, s2.params)
    assert max(jax.tree.leaves(diff)) <= 1e-5
    for k in m1:
        assert abs(float(m1[k]) - float(m2[k])) <= 1e-5, k
    assert int(s2.step) == 1


def test_init_state_splits_the_moments_like_the_params(tiny):
    """On the 8-device mesh each AdamW moment takes its param's layout from the sharding
    table (a device holds its shard of the embedding's moments, not a whole copy), the
    counters and the step are replicated, and the moments are the zeros the one-device
    init makes."""
    _, params = tiny
    opt = make_optimizer(STEP_OPTIM)
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    state = init_state(place(jax.tree.map(jnp.copy, params), mesh), opt, mesh)
    adam = state.opt_state[1][0]  # chain(clip, adamw): adamw = chain(scale_by_adam, weight decay, lr)
    assert isinstance(adam, optax.ScaleByAdamState)
    for moment in (adam.mu, adam.nu):
        for path, x in shd.flatten_params(moment).items():
            table = shd.param_sharding(path, x.shape, mesh)
            assert x.sharding.is_equivalent_to(table, x.ndim), path
            assert {s.data.shape for s in x.addressable_shards} == {table.shard_shape(x.shape)}, path
            assert not np.asarray(x).any(), path
    assert adam.mu["embed"].addressable_shards[0].data.shape == (CFG.vocab_size // 2, CFG.d_model // 4)
    assert adam.count.sharding.is_fully_replicated and state.step.sharding.is_fully_replicated


def test_checkpoint_with_replicated_moments_restores_split(tiny, tmp_path):
    """A checkpoint written when init_state replicated the moments on every device restores
    into the new layout (`abstract_state` of a fresh init_state): the same values, each
    moment split as its param."""
    from car_jax.checkpoints.train_state import TrainCheckpointer, abstract_state
    _, params = tiny
    opt = make_optimizer(STEP_OPTIM)
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    state = init_state(place(jax.tree.map(jnp.copy, params), mesh), opt, mesh)
    rng = np.random.default_rng(0)
    old = state.replace(opt_state=jax.tree.map(  # random moments, replicated as the old init_state left them
        lambda x: jax.device_put(rng.normal(size=x.shape).astype(x.dtype), NamedSharding(mesh, P())), state.opt_state))
    with TrainCheckpointer(tmp_path / "ck", every=1, async_save=False) as ck:
        ck.save(1, old, {})
        restored, _ = ck.restore(1, abstract_state(state))
    for a, b, fresh in zip(jax.tree.leaves(old.opt_state), jax.tree.leaves(restored.opt_state),
                           jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(fresh.sharding, b.ndim)
    assert not restored.opt_state[1][0].mu["embed"].sharding.is_fully_replicated


def test_sft_step_lowers_the_loss(tiny):
    module, params = tiny
    opt = make_optimizer(OptimConfig(lr=3e-3, total_steps=20))
    data = make_batch(n=4, micro=2)
    step = make_sft_step(module, opt)
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    losses = []
    for _ in range(15):
        state, m = step(state, data)
        losses.append(float(m["sft_loss"]))
    assert losses[-1] < 0.7 * losses[0]


def test_batch_keys_cover_the_loss(tiny):
    assert set(make_batch()) == set(BATCH_KEYS)
    assert set(make_batch(share=False)) == set(BATCH_KEYS)


def test_remat_gives_the_same_gradients(tiny):
    module, params = tiny
    cfg = grpo.LossConfig(kl_coef=0.0)
    batch = make_batch(n=4)
    fn = jax.jit(grads_and_metrics, static_argnums=(0, 1))
    g_plain, _, loss_plain = fn(module, cfg, params, batch)
    g_remat, _, loss_remat = fn(module.clone(remat=True), cfg, params, batch)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g_plain, g_remat)
    assert max(jax.tree.leaves(diff)) <= 1e-6 and float(loss_plain) == pytest.approx(float(loss_remat), abs=1e-7)


def test_init_state_is_committed_like_a_stepped_state(tiny):
    """init_state commits every leaf as a jitted step's outputs are, so the step's second
    call sees the same argument signature and is not compiled again (a state with some
    uncommitted leaves was: 10 s lost per run on the 135M model)."""
    module, params = tiny
    opt = make_optimizer(OptimConfig(lr=1e-3, total_steps=10))
    step = make_train_step(module, opt, grpo.LossConfig(), temperature=1.0)
    params = jax.device_put(jax.tree.map(jnp.copy, params), jax.devices()[0])  # committed, as load_model's
    state = init_state(params, opt)
    before = jax.tree.map(lambda x: (x.sharding, x.committed), state)
    state, _ = step(state, make_batch(n=4, micro=2))
    assert jax.tree.map(lambda x: (x.sharding, x.committed), state) == before


@pytest.mark.parametrize("dtype,remat", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_layer_loop_equals_the_scan(tiny, dtype, remat):
    """Split layers (the Python loop the bf16 train steps use under the CPU policy) give
    the loss and the gradients of the stacked layers (the scan). In bf16 the two graphs
    round their bf16 intermediates at different places, hence the 2% tolerance there."""
    import dataclasses
    module, params = tiny
    module = dataclasses.replace(module, dtype=jnp.dtype(dtype), remat=remat, policy=XLA_CPU)
    batch = {k: v[0] for k, v in make_batch(n=4).items()}

    def loss(p):
        logp, ent = micro_logprobs(module, p, batch)
        return (logp * batch["mask"]).sum() + 0.1 * (ent * batch["mask"]).sum()

    l_scan, g_scan = jax.jit(jax.value_and_grad(loss))(params)
    l_loop, g_loop = jax.jit(jax.value_and_grad(loss))(unstack_layers(params))
    g_loop = stack_layers(g_loop)
    rel = 1e-5 if dtype == "float32" else 2e-2
    assert abs(float(l_loop) - float(l_scan)) <= rel * abs(float(l_scan))
    for a, b in zip(jax.tree.leaves(g_loop), jax.tree.leaves(g_scan)):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=rel * max(scale, 1e-3))
    # the train steps pick the loop for bf16 under the CPU policy only
    split = isinstance(module.policy.train_params(params, module.dtype)["layers"], tuple)
    assert split == (dtype == "bfloat16")
    assert PLAIN.train_params(params, module.dtype) is params


def np_mismatch(trainer, sampler, mask, cap=None):
    """The mismatch metrics written out over the sampled tokens: d = log pi_trainer - log pi_sampler."""
    d = (trainer - sampler)[mask > 0].astype(np.float64)
    out = {"mismatch/abs_dlogp": np.abs(d).mean(),
           "mismatch/k3": (np.exp(d) - d - 1).mean(),  # KL(sampler || trainer), sampled from the sampler
           "mismatch/max_ratio": np.exp(d).max()}
    if cap is not None:
        out["mismatch/tis_clipfrac"] = (np.exp(d) > cap).mean()
    return out


def test_mismatch_metrics_match_numpy():
    rng = np.random.default_rng(0)
    trainer = rng.normal(-3, 1, size=(5, 7)).astype(np.float32)
    sampler = (trainer + rng.normal(0, 0.6, size=(5, 7))).astype(np.float32)
    mask = (rng.uniform(size=(5, 7)) < 0.7).astype(np.float32)
    mask[3] = 0  # a dropped row
    sampler[3, 0] = trainer[3, 0] - 9.0  # a huge gap outside the loss is not counted
    for cap in (None, 1.5):
        got = mismatch_metrics(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask), cap)
        want = np_mismatch(trainer, sampler, mask, cap)
        assert set(got) == set(want)
        for k, v in want.items():
            assert float(got[k]) == pytest.approx(v, rel=1e-5), k
    assert 0 < want["mismatch/tis_clipfrac"] < 1 and want["mismatch/max_ratio"] < np.exp(9.0)


@pytest.fixture(scope="module")
def recorded(tiny):
    """(host, device batch, the trainer's log-probs float32[8, R]) of 8 trajectories whose
    recorded sampler log-probs are deliberately wrong: about -1, where the random model
    gives about log(1/64)."""
    module, params = tiny
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(1, 64, size=rng.integers(2, 6))) for _ in range(4)]
    trajs = []
    for i in range(8):
        r = int(rng.integers(2, 9))
        trajs.append(Trajectory(prompts[i // 2], rng.integers(0, 64, size=r), rng.normal(-1.0, 0.1, size=r),
                                rng.uniform(size=r) < 0.85))
    host = host_batch(trajs, 0)
    batch = to_device(host).replace(advantages=jnp.asarray(rng.normal(size=8), jnp.float32))
    trainer = np.asarray(chunked_logprobs(make_logprob_fn(module, 1.0), params, batch,
                                          micro_plan(host.prompt_of, np.arange(8), 4)))
    return host, batch, trainer


def run_update(tiny, recorded, overrides, train_step=None):
    """Trainer.update of the recorded batch (one mini-batch of 8 rows, micro-batches of 4)
    by a Trainer holding only what update reads (no model loading, data or tools), with the
    unsharded step of test_sharded_step_equals_unsharded (its loss is STEP_LOSS: the
    overrides must agree) or the given one."""
    module, params = tiny
    host, batch, _ = recorded
    cfg = load_config(TrainConfig, None, ["rl.loss.kl_coef=0.001", "rl.mini_batch=8", "rl.micro_batch=4",
                                          *overrides])
    opt = make_optimizer(STEP_OPTIM)
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = cfg
    trainer.setup = Setup(model=Model(CFG, None, module), tokenizer=None,
                      state=init_state(jax.tree.map(jnp.copy, params), opt), ref_params=jax.tree.map(jnp.copy, params),
                      train_step=train_step or make_train_step(module, opt, STEP_LOSS, temperature=1.0),
                      logprob_fn=make_logprob_fn(module, 1.0), score=None, toolbox=None, protocol=None)
    return trainer.update(batch, host.prompt_of, Timer(), step=1)


def test_recompute_old_logp_makes_the_first_ratio_one(tiny, recorded):
    """With rl.recompute_old_logp the first update's ratio is 1 (ppo_kl 0, nothing clipped)
    although the recorded log-probs are far off (mean |dlogp| > 2); with TIS on, the policy
    term is the numpy one, token-mean of -A * min(exp(trainer - sampler), cap), and the
    mismatch metrics are the numpy ones."""
    host, batch, trainer = recorded
    m = run_update(tiny, recorded, ["rl.recompute_old_logp=true", f"rl.loss.tis_cap={STEP_LOSS.tis_cap}"])
    assert abs(m["ppo_kl"]) <= 1e-6 and m["pg_clipfrac"] == 0.0
    w = np.minimum(np.exp(trainer.astype(np.float64) - host.old_logp), STEP_LOSS.tis_cap)
    adv = np.asarray(batch.advantages, np.float64)[:, None]
    assert m["pg_loss"] == pytest.approx((-adv * w)[host.mask > 0].mean(), rel=1e-5)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy
    for k, v in np_mismatch(trainer, host.old_logp, host.mask, STEP_LOSS.tis_cap).items():
        assert m[k] == pytest.approx(v, rel=1e-5), k
    assert m["mismatch/abs_dlogp"] > 2.0 and m["mismatch/tis_clipfrac"] == 0.0  # pi_trainer << pi_sampler


@pytest.mark.parametrize("recompute", [False, True])
def test_update_feeds_the_step_its_old_logprobs(tiny, recorded, recompute):
    """What reaches the train step: without recompute_old_logp the sampler's log-probs as
    the old policy (the ratio of the first update is then not 1), with it the trainer's;
    the sampler's stay in sampler_logp either way. The mismatch metrics come with the
    recomputed log-probs only. (A recording step: nothing compiles.)"""
    host, _, trainer = recorded
    fed = []

    def step(state, micro):
        fed.append(jax.tree.map(np.asarray, micro))
        return state, {"loss": 0.0}

    m = run_update(tiny, recorded, ["rl.recompute_old_logp=true"] if recompute else [], step)
    assert len(fed) == 1 and any(k.startswith("mismatch/") for k in m) == recompute
    tokens = fed[0]["tokens"].reshape(8, -1)  # [M * b, R], in the update's shuffled order
    rows = [int(np.flatnonzero((host.tokens == t).all(1))[0]) for t in tokens]  # each row's trajectory
    assert sorted(rows) == list(range(8))
    valid = host.valid[rows]
    np.testing.assert_array_equal(fed[0]["sampler_logp"].reshape(8, -1)[valid], host.old_logp[rows][valid])
    want = trainer if recompute else host.old_logp
    np.testing.assert_allclose(fed[0]["old_logp"].reshape(8, -1)[valid], want[rows][valid], atol=1e-6)
