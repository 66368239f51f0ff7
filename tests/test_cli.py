"""The CLI's persistent XLA compilation cache."""
import os
import subprocess
import sys

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from car_jax.cli import enable_compilation_cache
print(enable_compilation_cache(min_seconds=0.0))
jax.jit(lambda x: jnp.tanh(x @ x.T))(jnp.ones((8, 8))).block_until_ready()
"""


def run(env_value):
    env = {**os.environ, "CAR_JAX_XLA_CACHE": env_value, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_compiled_programs_are_written_to_the_cache_folder(tmp_path):
    folder = tmp_path / "xla"
    assert run(str(folder)) == str(folder)
    assert any(folder.iterdir())  # the jitted program was stored


def test_the_cache_can_be_turned_off(tmp_path):
    assert run("off") == "None"
