"""The rollout's prefill and decode loop (`Decoder.__call__` with a KV cache) on the fake
8-device mesh with the params in the sharding table's train layout, as the trainer samples
with them: the same tokens, log-probs and cache as on one device, and a prefill compiled so
that each device runs its own rows (`Decoder.rows`, the table's "hidden" entry)."""
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
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.plan.xla import Compiled, abstract_params
from car_jax.rollout.decode import DecodeLoop
from car_jax.rollout.prefill import prefill
from car_jax.rollout.sampling import Sampler

CFG = ModelConfig("qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qkv_bias=True)
B, T, S, STEPS = 8, 6, 24, 5  # rows, prompt width, cache slots, decode steps


def random_params(module: Decoder):
    """numpy arrays: placed on the mesh from the host, without the slicing program that
    splitting a device array compiles for every weight shape."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(x.dtype), shapes)


def rollout(module: Decoder, params, mesh):
    """Prefill B left-padded prompts, then STEPS greedy tokens: (SegmentOut, cache)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, T + 1, size=B)
    tokens = rng.integers(1, CFG.vocab_size, size=(B, T)).astype(np.int32)
    valid = np.arange(T)[None, :] >= (T - lengths)[:, None]
    rows = None if mesh is None else NamedSharding(mesh, P("fsdp"))
    put = (lambda x: jnp.asarray(x)) if mesh is None else (lambda x: jax.device_put(x, rows))
    cache = module.policy.init_cache(CFG, B, S, module.dtype, mesh)
    logits, cache = prefill(module, params, cache, put(np.where(valid, tokens, 0)), put(valid))
    no_stops = jnp.zeros((1, 2, CFG.vocab_size), jnp.int32)  # one automaton that never completes
    return DecodeLoop(module=module, sampler=Sampler(), max_steps=STEPS).segment(
        params=params, cache=cache, logits=logits, live=put(np.ones(B, bool)), eos_ids=jnp.asarray([-1], jnp.int32),
        tables=no_stops, key=jax.random.key(0))


# Both cache layouts (stacked, and XLA:CPU's one array per layer) with kv heads over tp = 2,
# and the plain one on fsdp = 8 (a row per device): the two meshes run the same car_jax code
# but for the tp split, so XLA:CPU on fsdp = 8 would repeat its (4, 2) case without tp.
@pytest.mark.parametrize("fsdp,tp,policy", [(4, 2, PLAIN), (8, 1, PLAIN), (4, 2, XLA_CPU)],
                         ids=["4-2-plain", "8-1-plain", "4-2-xla_cpu"])
def test_prefill_and_decode_on_the_mesh_equal_one_device(policy, fsdp, tp):
    """Train-layout params (weights' D over fsdp) and a cache with rows over fsdp: the
    greedy tokens are equal, the log-probs and the cache's keys and values equal to float
    rounding (the mesh splits contractions over fsdp / tp: another float32 summation order)."""
    module = Decoder(CFG, policy=policy)
    params = random_params(module)
    mesh = car_jax.make_mesh(fsdp=fsdp, tp=tp)
    out, cache = rollout(module, jax.device_put(params, shd.params_shardings(params, mesh, "train")), mesh)
    ref, ref_cache = rollout(module, jax.tree.map(jnp.asarray, params), None)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.length), np.full(B, STEPS))
    np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), rtol=0, atol=1e-5)
    assert np.asarray(ref.logp).min() < -1  # real log-probs, not a pass of zeros
    for a, b in zip(jax.tree.leaves((cache.k, cache.v)), jax.tree.leaves((ref_cache.k, ref_cache.v)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.valid), np.asarray(ref_cache.valid))


def compiled_prefill(module: Decoder, fsdp: int, rows: int, t: int):
    """prefill compiled from abstract inputs (no weights) on a fsdp x 1 mesh: params in
    the train layout, cache and chunk rows over fsdp."""
    mesh = car_jax.make_mesh(fsdp=fsdp, tp=1, devices=jax.devices()[:fsdp])
    cache = jax.eval_shape(lambda: module.policy.init_cache(CFG, rows, 2 * t, module.dtype, mesh))
    chunk = jax.ShapeDtypeStruct((rows, t), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None)))
    valid = jax.ShapeDtypeStruct((rows, t), bool, sharding=chunk.sharding)
    return prefill.lower(module, abstract_params(module, mesh), cache, chunk, valid).compile()


def test_compiled_prefill_runs_each_devices_rows_only():
    """fsdp=4, 32 rows of 16 tokens: every matmul of a layer (q / k / v / o, gate / up /
    down: 2-D dots [X, out] in the per-device HLO module) runs over the device's 8 x 16 =
    128 token rows, none over the 512 of the whole chunk (without the rows constraint XLA
    follows the weights' D-over-fsdp layout and every device holds [512, out] partial sums),
    and the vocabulary projection over its 8 rows; the per-device temporaries are below the
    one-device program's (before the fix: 1.3x above it)."""
    module = Decoder(CFG, policy=PLAIN)
    rows, t, fsdp = 32, 16, 4
    sharded, single = compiled_prefill(module, fsdp, rows, t), compiled_prefill(module, 1, rows, t)
    dots = re.findall(r"= f32\[(\d+),\d+\]\{1,0\} dot\(.*op_name=\"([^\"]+)\"", sharded.as_text())
    layer = [int(x) for x, op in dots if "/Block/" in op]
    head = [int(x) for x, op in dots if "unembed" in op]
    assert len(layer) >= 7 and set(layer) == {rows * t // fsdp}, dots  # 7 matmuls a layer, at least
    assert head == [rows // fsdp], dots
    assert Compiled.of(sharded).temp < Compiled.of(single).temp
