"""Loading onto a mesh puts every tensor in the table's sharding and changes no logit."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import car_jax
from car_jax import sharding as shd
from car_jax.models.policy import PLAIN, XLA_CPU
from tests.hf_factory import build


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    # 8 kv heads and 8 heads so tp=2 divides them; vocab 96 divides 2, 4 and 8
    build("qwen2", path, num_attention_heads=8, num_key_value_heads=4, hidden_size=64, head_dim=8)
    return path


def test_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("fsdp,tp,mode", [(4, 2, "train"), (8, 1, "train"), (-1, 2, "sample")])
def test_sharded_load_matches_table_and_unsharded_logits(folder, fsdp, tp, mode):
    mesh = car_jax.make_mesh(fsdp=fsdp, tp=tp)
    model = car_jax.load_model(folder, mesh=mesh, mode=mode)
    for path, array in shd.flatten_params(model.params).items():
        expected = NamedSharding(mesh, shd.spec_for(shd.PARAM_AXES[path], mode))
        assert array.sharding.is_equivalent_to(expected, array.ndim), path
    # training splits weights over every mesh axis; sampling keeps them whole over fsdp
    specs = {a.sharding.spec for a in shd.flatten_params(model.params).values()}
    used = {ax for spec in specs for ax in spec if ax and mesh.shape[ax] > 1}
    wanted = {ax for ax, n in mesh.shape.items() if n > 1}
    assert used == (wanted if mode == "train" else wanted - {"fsdp"})

    tokens = np.random.default_rng(0).integers(0, 96, size=(8, 10))
    ref = np.asarray(car_jax.load_model(folder).logits(tokens))
    assert np.abs(np.asarray(model.logits(tokens)) - ref).max() <= 1e-5


def test_mesh_errors_name_the_problem(folder):
    with pytest.raises(shd.ShardingError, match="does not fit 8 devices"):
        car_jax.make_mesh(fsdp=3, tp=-1)
    with pytest.raises(shd.ShardingError, match="at most one"):
        car_jax.make_mesh(fsdp=-1, tp=-1)
    mesh = car_jax.make_mesh(fsdp=1, tp=8)  # 4 kv heads cannot be split 8 ways
    with pytest.raises(shd.ShardingError, match=r"layers/attn/k.*kv_heads=4.*'tp' of size 8"):
        car_jax.load_model(folder, mesh=mesh)


@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)
def test_cache_on_a_mesh_is_split_and_decodes_the_same(folder, policy):
    """The stacked cache (plain) and the per-layer one (XLA_CPU) on the 8-device mesh:
    rows over fsdp, kv heads over tp, the layer axis whole; prefill and a decode step
    give the unsharded logits, and the sharded cache holds the unsharded cache's values."""
    import jax.numpy as jnp
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    sharded = car_jax.load_model(folder, mesh=mesh, mode="sample", policy=policy)
    plain = car_jax.load_model(folder, policy=policy)
    cache = sharded.init_cache(8, 16)
    one_layer = policy is XLA_CPU
    for side, name in ((cache.k, "cache_k"), (cache.v, "cache_v")):
        want = shd.data_sharding(name, jax.tree.leaves(side)[0].shape, mesh, "sample", one_layer=one_layer).spec
        assert all(a.sharding.spec == want for a in jax.tree.leaves(side))
    # 8 rows / 4, 4 kv heads / 2; keys [(L,) B, K, H, S], values [(L,) B, K, S, H]
    layers = () if one_layer else (2,)
    assert jax.tree.leaves(cache.k)[0].addressable_shards[0].data.shape == (*layers, 2, 2, 8, 16)
    assert jax.tree.leaves(cache.v)[0].addressable_shards[0].data.shape == (*layers, 2, 2, 16, 8)
    if not one_layer:
        assert shd.DATA_AXES["cache_k"][0] == "layers" and cache.k.shape[0] == 2
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(8, 6)), jnp.int32)
    got, cache = sharded.forward(tokens[:, :5], None, cache)
    ref, ref_cache = plain.forward(tokens[:, :5], None, plain.init_cache(8, 16))
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5
    got, cache = sharded.forward(tokens[:, 5:], None, cache)
    ref, ref_cache = plain.forward(tokens[:, 5:], None, ref_cache)
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5
    for a, b in zip(jax.tree.leaves((cache.k, cache.v)), jax.tree.leaves((ref_cache.k, ref_cache.v)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        assert float(np.abs(np.asarray(b)).max()) > 0
    np.testing.assert_array_equal(np.asarray(cache.valid), np.asarray(ref_cache.valid))


def test_one_layer_sharding_drops_the_layer_axis(folder):
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    stacked = shd.data_sharding("cache_k", (2, 8, 4, 8, 16), mesh, "sample").spec
    one = shd.data_sharding("cache_k", (8, 4, 8, 16), mesh, "sample", one_layer=True).spec
    assert tuple(stacked) == (None, *one) and one[0] == "fsdp" and one[1] == "tp"
    with pytest.raises(shd.ShardingError, match="no leading 'layers' axis"):
        shd.data_sharding("rows", (8,), mesh, "sample", one_layer=True)
