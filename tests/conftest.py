"""Test setup: CPU only, a fake 8-device mesh, fp32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# LLVM -O0 for the code XLA:CPU generates (its default is -O2): the suite is mostly compiles
# of small programs. -O1 roughly halved the CPU time of a compile-bound file (greedy parity
# with transformers: 218 -> 112 s of user time); -O0 takes another quarter off (test_policy +
# test_generate, fresh caches: 154 -> 112 s of user+sys, the 30-layer model's text check
# included). Floating-point semantics stay the same at every level (no fast-math). What
# users run keeps XLA's default.
COMPILE_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in flags:
    flags += " " + COMPILE_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the whole run, in the repo's .cache/ (not the
# user's car_jax cache): many tests compile the same programs again (each Trainer or model
# builds fresh jitted closures; the multi-process tests launch new processes; pytest-xdist
# runs two workers), and JAX's cache, keyed by the HLO, the devices and the XLA flags, loads
# them instead. The CLI runs inside tests (and their subprocesses) read the same folder.
XLA_CACHE = os.environ.get("CAR_JAX_TEST_XLA_CACHE") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "test_xla")
os.environ.setdefault("CAR_JAX_XLA_CACHE", XLA_CACHE)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if XLA_CACHE.lower() != "off":
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop every compiled XLA program when a test file ends. Each XLA:CPU executable holds
    about six memory mappings for as long as a jit cache keeps it, and Linux allows a process
    65530 (vm.max_map_count): a worker that ran a few heavy files (test_train_step.py alone
    leaves ~12,000 mappings) died with a fatal error inside an XLA compile once it ran out.
    The persistent compilation cache reloads what a later file compiles again."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct GGUF converted once to an HF folder."""
    from car_jax.assets import smollm2_gguf
    from car_jax.checkpoints.convert import gguf_to_hf

    return gguf_to_hf(smollm2_gguf(), tmp_path_factory.mktemp("smollm2") / "hf")


# The slowest files first: pytest-xdist hands out whole files in collection order, so a long
# file collected last would leave the other worker idle at the end.
SLOW_FIRST = ("test_control.py", "test_multihost.py", "test_configs.py", "test_generate.py", "test_notebooks.py", "test_experiment.py",
              "test_eval.py", "test_confidence.py", "test_batches.py", "test_multihost_eval.py", "test_policy.py",
              "test_flash_attention.py", "test_gpu_check.py", "test_install.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept otherwise
