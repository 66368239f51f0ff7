"""Test setup: CPU only, a fake 8-device mesh, fp32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CAR_JAX_XLA_CACHE", "off")  # the CLI's compilation cache stays out of tests

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct GGUF converted once to an HF folder."""
    from car_jax.assets import smollm2_gguf
    from car_jax.checkpoints.convert import gguf_to_hf

    return gguf_to_hf(smollm2_gguf(), tmp_path_factory.mktemp("smollm2") / "hf")
