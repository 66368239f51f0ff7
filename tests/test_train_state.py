"""car_jax.checkpoints.train_state: orbax training checkpoints (periodic, keep-K, sharded
restore, typed PRNG keys, resume across processes, SIGKILL during a save)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax.checkpoints.train_state import TrainCheckpointer, abstract_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(scale: float = 1.0):
    params = {"w": jnp.arange(32.0).reshape(8, 4) * scale, "b": jnp.ones((4,)) * scale}
    opt = optax.adamw(1e-3).init(params)
    return {"params": params, "opt": opt, "step": jnp.int32(7),
            "key": jax.random.key(3), "raw_key": jax.random.PRNGKey(4)}


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_round_trip_with_optimizer_and_keys(tmp_path):
    state = _state()
    with TrainCheckpointer(tmp_path / "ck", every=1) as ck:
        assert ck.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ck.restore()
        assert ck.save(5, state, {"data_pos": 123, "config": "tiny", "lr": 1e-6})
        ck.wait()
        restored, meta = ck.restore(abstract_state=abstract_state(state))
    assert meta == {"data_pos": 123, "config": "tiny", "lr": 1e-6}
    _assert_tree_equal(restored, state)  # optax namedtuples and typed keys come back
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    # the restored key draws the same numbers as the saved one
    np.testing.assert_array_equal(jax.random.normal(restored["key"], (3,)),
                                  jax.random.normal(state["key"], (3,)))
    # no abstract state: values still come back (containers as orbax rebuilds them)
    with TrainCheckpointer(tmp_path / "ck") as ck:
        plain, _ = ck.restore(5)
    np.testing.assert_array_equal(plain["params"]["w"], state["params"]["w"])


def test_periodic_saves_keep_last_k_and_existing_step(tmp_path):
    d = tmp_path / "ck"
    with TrainCheckpointer(d, keep=2, every=2, async_save=False) as ck:
        saved = [s for s in range(1, 10) if ck.maybe_save(s, _state(s), {"s": s})]
        assert saved == [2, 4, 6, 8]
        assert ck.save(9, _state(9), {"s": 9})  # forced: not a multiple of every
        assert not ck.save(9, _state(9), {"s": 9})  # already saved: no error, no write
        assert not ck.maybe_save(8, _state(8))  # older than the latest step
        assert ck.all_steps() == [8, 9]
    assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == ["8", "9"]
    with TrainCheckpointer(d) as ck:  # a new instance sees what the old one wrote
        assert ck.latest_step() == 9
        state, meta = ck.restore(8, abstract_state(_state()))
        assert meta == {"s": 8}
        np.testing.assert_array_equal(state["params"]["b"], np.full(4, 8.0))
        with pytest.raises(FileNotFoundError, match=r"step 3 .*saved steps: \[8, 9\]"):
            ck.restore(3)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep=0"):
        TrainCheckpointer(tmp_path / "a", keep=0)
    with pytest.raises(ValueError, match="every=0"):
        TrainCheckpointer(tmp_path / "a", every=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TrainCheckpointer(tmp_path / "missing", read_only=True)
    with TrainCheckpointer(tmp_path / "b", every=1) as ck:
        with pytest.raises(ValueError, match="JSON-serializable"):
            ck.save(1, _state(), {"x": np.zeros(2)})
        ck.save(1, _state(), {})
    with TrainCheckpointer(tmp_path / "b", read_only=True) as ro:
        assert ro.latest_step() == 1
        with pytest.raises(RuntimeError, match="read_only"):
            ro.save(2, _state())


def test_sharded_restore_onto_requested_mesh(tmp_path):
    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    saved_sh = NamedSharding(mesh, P("data", "model"))
    w = jax.device_put(jnp.arange(64.0).reshape(16, 4), saved_sh)
    state = {"w": w, "count": jnp.int32(3)}
    with TrainCheckpointer(tmp_path / "ck", every=1) as ck:
        ck.save(1, state, {})
    # restore onto a different layout: rows over "model", columns replicated
    target_sh = NamedSharding(mesh, P("model", None))
    target = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=target_sh),
              "count": jax.ShapeDtypeStruct((), jnp.int32,
                                            sharding=NamedSharding(mesh, P()))}
    with TrainCheckpointer(tmp_path / "ck") as ck:
        restored, _ = ck.restore(abstract_state=target)
    assert restored["w"].sharding == target_sh
    assert restored["w"].addressable_shards[0].data.shape == (8, 4)
    np.testing.assert_array_equal(restored["w"], np.arange(64.0).reshape(16, 4))
    assert int(restored["count"]) == 3


_CHILD = textwrap.dedent("""
    import asyncio, os, pathlib, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from car_jax.checkpoints.train_state import TrainCheckpointer
    from orbax.checkpoint._src.path import async_path

    directory = sys.argv[1]
    ck = TrainCheckpointer(directory, every=1)
    ck.save(1, {"w": jnp.full((1024,), 1.0), "key": jax.random.key(1)}, {"pos": 1})
    ck.wait()
    # From here on the commit of a save (rename of the tmp folder) blocks forever, so the
    # parent can kill this process at a known point: after the step's data is written
    # ("before_commit"), or as soon as the step's tmp folder exists ("mid_write").
    rename = async_path.rename
    async def blocked_rename(src, dst):
        pathlib.Path(directory, "READY").write_text(str(src))
        await asyncio.sleep(3600)
    async_path.rename = blocked_rename
    ck.save(2, {"w": jnp.full((1 << 20,), 2.0), "key": jax.random.key(2)}, {"pos": 2})
    pathlib.Path(directory, "STARTED").write_text("")
    time.sleep(3600)
""")


@pytest.mark.parametrize("mode", ["mid_write", "before_commit"])
def test_sigkill_during_save_keeps_previous_step(tmp_path, mode):
    d = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": REPO}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(d)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            tmp_dirs = [p for p in d.glob("2.orbax-checkpoint-tmp*")] if d.exists() else []
            if (mode == "mid_write" and tmp_dirs) or (d / "READY").exists():
                break
            if child.poll() is not None:
                pytest.fail(f"child exited ({child.returncode}) before the save of step 2 "
                            f"was caught:\n{child.stdout.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, "child never started saving step 2"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert list(d.glob("2.orbax-checkpoint-tmp*")), "the interrupted save left no tmp folder"
    assert not (d / "2").exists()
    # A reader (and a resumed writer) sees step 1 as the latest, intact.
    with TrainCheckpointer(d, read_only=True) as ro:
        assert ro.all_steps() == [1]
    abstract = {"w": jax.ShapeDtypeStruct((1024,), jnp.float32),
                "key": jax.eval_shape(lambda: jax.random.key(0))}
    with TrainCheckpointer(d, every=1) as ck:
        assert ck.latest_step() == 1
        state, meta = ck.restore(abstract_state=abstract)
        assert meta == {"pos": 1}
        np.testing.assert_array_equal(state["w"], np.ones(1024, np.float32))
        np.testing.assert_array_equal(jax.random.key_data(state["key"]),
                                      jax.random.key_data(jax.random.key(1)))
        # the writer removes the leftover (in the background, awaited by its next save)
        # and saves step 2 again
        assert ck.save(2, {"w": jnp.full((1024,), 2.0), "key": jax.random.key(2)}, {"pos": 2})
        ck.wait()
        assert ck.all_steps() == [1, 2]
        assert not list(d.glob("*orbax-checkpoint-tmp*"))
        assert ck.restore(2, abstract)[1] == {"pos": 2}
