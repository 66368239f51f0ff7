"""car_jax: calibration-aware agentic RL (CAR) for tool-using LLM agents, in JAX/Flax.

The public API is re-exported here lazily, so `import car_jax` stays cheap (no jax
compilation, no transformers import) until a name is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None re-exports the module itself.
_EXPORTS = {
    "load_model": ("car_jax.loading", "load_model"),
    "load_tokenizer": ("car_jax.loading", "load_tokenizer"),
    "save_hf": ("car_jax.loading", "save_hf"),
    "Model": ("car_jax.loading", "Model"),
    "ModelConfig": ("car_jax.models.config", "ModelConfig"),
    "make_mesh": ("car_jax.sharding", "make_mesh"),
    "rewards": ("car_jax.calibration.rewards", None),
    "metrics": ("car_jax.calibration.metrics", None),
}

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """The module's names with the lazy exports, loaded or not (for `dir()` and completion)."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'car_jax' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
