"""Start-up of a multi-process run (`car_jax/cli/distributed.py`): which environment asks for
`jax.distributed.initialize` and with which arguments, the one-line errors of an incomplete or
malformed environment, and two real processes on loopback that see each other's devices and
sum an array across both."""
import sys

import jax
import pytest

from car_jax.cli import distributed, main
from car_jax.config import ConfigError
from tests.multihost import run_processes, succeeded

VARIABLES = (*distributed.TRIPLE, distributed.AUTO, distributed.LOCAL_IDS,
             "JAX_CPU_COLLECTIVES_IMPLEMENTATION")


@pytest.fixture()
def calls(monkeypatch):
    """A clean environment and a recording `jax.distributed.initialize` (nothing connects):
    the list of ("update", name, value) / ("initialize", kwargs) calls in order."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    recorded = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: recorded.append(("initialize", kw)))
    monkeypatch.setattr(jax.config, "update", lambda name, value: recorded.append(("update", name, value)))
    return recorded


def set_env(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_nothing_set_is_a_single_process(calls):
    assert distributed.maybe_init_distributed() is False
    assert calls == []


def test_the_full_triple_is_passed_on_after_gloo_is_chosen(calls, monkeypatch):
    set_env(monkeypatch, JAX_COORDINATOR_ADDRESS="10.1.2.3:7001", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="3")
    assert distributed.maybe_init_distributed() is True
    assert calls == [("update", "jax_cpu_collectives_implementation", "gloo"),
                     ("initialize", {"coordinator_address": "10.1.2.3:7001", "num_processes": 4,
                                     "process_id": 3})]


def test_local_device_ids_are_parsed(calls, monkeypatch):
    set_env(monkeypatch, JAX_COORDINATOR_ADDRESS="node0:7001", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0",
            JAX_LOCAL_DEVICE_IDS="2, 3")
    distributed.maybe_init_distributed()
    assert calls[-1][1]["local_device_ids"] == [2, 3]


def test_an_explicit_cpu_collectives_choice_is_kept(calls, monkeypatch):
    set_env(monkeypatch, CAR_JAX_DISTRIBUTED="1", JAX_CPU_COLLECTIVES_IMPLEMENTATION="mpi")
    distributed.maybe_init_distributed()
    assert [c[0] for c in calls] == ["initialize"]


def test_auto_detection_calls_initialize_without_arguments(calls, monkeypatch):
    set_env(monkeypatch, CAR_JAX_DISTRIBUTED="1")
    assert distributed.maybe_init_distributed() is True
    assert calls[-1] == ("initialize", {})


def test_auto_detection_keeps_what_is_set(calls, monkeypatch):
    """With CAR_JAX_DISTRIBUTED=1 a partial triple is not an error: JAX detects the rest."""
    set_env(monkeypatch, CAR_JAX_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS="10.0.0.9:8476")
    distributed.maybe_init_distributed()
    assert calls[-1] == ("initialize", {"coordinator_address": "10.0.0.9:8476"})


def test_an_initialised_runtime_is_left_alone(calls, monkeypatch):
    set_env(monkeypatch, CAR_JAX_DISTRIBUTED="1")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert distributed.maybe_init_distributed() is True
    assert calls == []


@pytest.mark.parametrize("present", [
    ("JAX_COORDINATOR_ADDRESS",),
    ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID"),
    ("JAX_PROCESS_ID",),
])
def test_a_partial_triple_names_what_is_missing(calls, monkeypatch, present):
    values = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    set_env(monkeypatch, **{name: values[name] for name in present})
    with pytest.raises(ConfigError) as err:
        distributed.maybe_init_distributed()
    message = str(err.value)
    missing = [name for name in values if name not in present]
    assert message.startswith(" and ".join(missing) + " not set")
    assert f"{distributed.AUTO}=1" in message  # the other way out
    assert calls == []


@pytest.mark.parametrize("name, value, expected", [
    ("JAX_NUM_PROCESSES", "two", "an integer >= 1"),
    ("JAX_NUM_PROCESSES", "0", "an integer >= 1"),
    ("JAX_PROCESS_ID", "2", "an integer in 0..1"),
    ("JAX_PROCESS_ID", "-1", "an integer in 0..1"),
    ("JAX_PROCESS_ID", "1.0", "an integer in 0..1"),
    ("JAX_COORDINATOR_ADDRESS", "10.0.0.1", "host:port"),
    ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:http", "host:port"),
    ("JAX_LOCAL_DEVICE_IDS", "0;1", "comma-separated"),
    ("CAR_JAX_DISTRIBUTED", "yes", "must be 1"),
])
def test_a_bad_value_is_named_with_what_is_expected(calls, monkeypatch, name, value, expected):
    set_env(monkeypatch, JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        distributed.maybe_init_distributed()
    assert f"{name}={value!r} must be" in str(err.value) and expected in str(err.value)
    assert calls == []


def test_auto_detection_that_finds_nothing_is_one_clear_error(calls, monkeypatch):
    def no_cluster(**kwargs):
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    set_env(monkeypatch, CAR_JAX_DISTRIBUTED="1")
    with pytest.raises(ConfigError, match="CAR_JAX_DISTRIBUTED=1: JAX found no .*JAX_NUM_PROCESSES"):
        distributed.maybe_init_distributed()


def test_the_cli_prints_one_line_and_exits_2(calls, monkeypatch, capsys):
    set_env(monkeypatch, JAX_COORDINATOR_ADDRESS="10.0.0.1:1234")
    assert main(["train", "rl.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("car-jax train: error: JAX_NUM_PROCESSES and JAX_PROCESS_ID not set")


# ---------------------------------------------------------------- two real processes
WORKER = """
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from car_jax.cli import maybe_init_distributed

assert maybe_init_distributed()
assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
mesh = jax.make_mesh((4,), ("d",))
rank = jax.process_index()
local = np.array([2 * rank + 1, 2 * rank + 2], np.int32)  # process 0: [1, 2], process 1: [3, 4]
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local, (4,))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(f"process {rank} of {jax.process_count()}: sum {int(total)}", flush=True)
"""


def test_two_processes_on_loopback_sum_across_each_other():
    results = run_processes([sys.executable, "-c", WORKER], processes=2, devices=2, timeout=90)
    succeeded(results)
    for rank, (_, out, _) in enumerate(results):
        assert f"process {rank} of 2: sum {sum(range(1, 5))}" in out
