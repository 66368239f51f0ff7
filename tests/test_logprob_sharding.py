"""The reference / old-policy log-prob pass and the SFT step on the fake 8-device mesh
(fsdp=8): laid out as the train step is (params in the table's train layout, rows over
fsdp), equal to the pass without a mesh, and compiled so that each device runs its own
b/8 rows."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import car_jax
from car_jax import sharding as shd
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.rl.batches import chunked_logprobs, micro_batches, to_device
from car_jax.rl.host_batch import host_batch, micro_plan
from car_jax.rl.steps import (
    OptimConfig,
    batch_shardings,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_sft_step,
    state_shardings,
)
from car_jax.rollout.episode import Trajectory

CFG = ModelConfig("qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qkv_bias=True)
N, MICRO = 32, 16  # rows, micro-batch size: M = 2 micro-batches of b = 16 rows, 2 per device


@pytest.fixture(scope="module")
def setup():
    """(module, params on one device, mesh fsdp=8, params in the table's train layout, host batch)."""
    module = Decoder(CFG)
    # random params of the module's shapes (`module.init` would compile a forward pass)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    host_params = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(x.dtype), shapes)
    params = jax.tree.map(jnp.asarray, host_params)
    mesh = car_jax.make_mesh(fsdp=8, tp=1)
    prompts = [rng.integers(1, 64, size=rng.integers(2, 6)) for _ in range(N // 2)]
    trajs = []
    for i in range(N):
        r = int(rng.integers(1, 9))
        trajs.append(Trajectory(prompts[i // 2], rng.integers(0, 64, size=r), rng.normal(-4, 0.2, size=r),
                                rng.uniform(size=r) < 0.85))
    # placed from the host arrays: splitting a device array compiles a slicing program per weight shape
    sharded = jax.device_put(host_params, shd.params_shardings(host_params, mesh))
    return module, params, mesh, sharded, host_batch(trajs, 0)


def sharded_fn(module, mesh, sharded_params):
    """The mesh pass, its params in the table's train layout (the train state's)."""
    shardings = jax.tree.map(lambda x: x.sharding, sharded_params)
    return make_logprob_fn(module, 0.8, mesh=mesh, params_shardings=shardings)


def test_sharded_logprobs_equal_unsharded(setup):
    """The mesh pass (rows over fsdp, positional prompts) equals the one-device pass (shared
    prompts) row for row, and its logp float32[M, b, R] comes back rows over fsdp."""
    module, params, mesh, sharded_params, host = setup
    order = np.random.default_rng(1).permutation(N)
    one_plan, mesh_plan = micro_plan(host.prompt_of, order, MICRO), micro_plan(host.prompt_of, order, MICRO, False)
    single = chunked_logprobs(make_logprob_fn(module, 0.8), params, to_device(host), one_plan)
    fn, rows = sharded_fn(module, mesh, sharded_params), to_device(host, mesh)
    logp = fn(sharded_params, micro_batches(rows, mesh_plan, mesh))
    assert logp.shape == (N // MICRO, MICRO, host.tokens.shape[1]) and logp.dtype == jnp.float32
    assert logp.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp", None)), 3)
    sharded = chunked_logprobs(fn, sharded_params, rows, mesh_plan, mesh)
    valid = host.valid
    # the mesh splits the embed contraction over fsdp (another float32 summation order): about
    # 2 ulps of |logp| in [4, 8) (ulp 4.8e-7), 9.5e-7 measured
    np.testing.assert_allclose(np.asarray(sharded)[valid], np.asarray(single)[valid], rtol=0, atol=1e-6)
    assert np.asarray(single)[valid].min() < -1  # real log-probs, not a pass of zeros


def test_compiled_logprob_pass_splits_rows_over_fsdp(setup):
    """Lowered from shapes alone (no shardings on the arguments, as a planner lowers it), the
    compiled pass still takes params and batch in the train step's layout and each device's
    HLO module holds b/8 rows: its tokens parameter and its result are [M, b/8, R], and no
    parameter or result has all b rows."""
    module, _, mesh, sharded_params, host = setup
    fn = sharded_fn(module, mesh, sharded_params)
    batch = micro_batches(to_device(host, mesh), micro_plan(host.prompt_of, np.arange(N), MICRO, share=False), mesh)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (sharded_params, batch))
    compiled = fn.lower(*abstract).compile()
    m, b, r = batch["tokens"].shape
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp", None)), 3)
    params_in, batch_in = compiled.input_shardings[0]
    want = batch_shardings(mesh)
    read = ("prompt", "prompt_valid", "tokens", "valid")  # the keys the pass reads (the rest are pruned)
    assert all(batch_in[k].is_equivalent_to(want[k], batch[k].ndim) for k in read)
    table = shd.flatten_params(shd.params_shardings(sharded_params, mesh))
    flat = shd.flatten_params(sharded_params)
    assert all(s.is_equivalent_to(table[p], flat[p].ndim) for p, s in shd.flatten_params(params_in).items())
    entry = next(line for line in compiled.as_text().splitlines() if line.startswith("ENTRY"))
    per_device = b // mesh.shape["fsdp"]
    assert f"-> f32[{m},{per_device},{r}]" in entry, entry
    assert f"s32[{m},{per_device},{r}]" in entry, entry  # tokens int32[M, b/8, R]
    assert not re.search(rf"\[{m},{b},\d+\]", entry), entry  # no argument with the whole batch


def test_sft_step_on_the_mesh_keeps_the_table_layout(setup):
    """One SFT step on the mesh: the params come back in the sharding table's train layout
    (the jitted step's out_shardings), and the loss is finite."""
    module, _, mesh, sharded_params, host = setup
    opt = make_optimizer(OptimConfig(lr=1e-3, weight_decay=0.0))
    state = init_state(jax.tree.map(jnp.copy, sharded_params), opt, mesh)
    step = make_sft_step(module, opt, mesh, state_shardings(state))
    batch = micro_batches(to_device(host, mesh), micro_plan(host.prompt_of, np.arange(N), MICRO, share=False), mesh)
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["sft_loss"]))
    table = shd.flatten_params(shd.params_shardings(sharded_params, mesh))
    flat = shd.flatten_params(state.params)
    assert [p for p, x in flat.items() if not x.sharding.is_equivalent_to(table[p], x.ndim)] == []
