"""The architecture of a config's policy without its weights: the HF `config.json`.

`model_config(path)` reads, in order: a local checkpoint at `path` (an HF folder with a
config.json, a .gguf file, a car_jax params folder: `checkpoints.sources.read_config`);
else the copy shipped inside the package under car_jax/configs/models/<org>/<name>/config.json
(a clone's configs/models; `car_jax.assets.shipped_models`, package data), found
by the hub id ("Qwen/Qwen2.5-3B-Instruct") or by the path's last part (a placeholder such as
"/path/to/Qwen2.5-3B-Instruct", as the shipped training configs hold); "" is the embedded
SmolLM2-135M-Instruct (its GGUF header). The shipped copies are written from each
model's public config.json (sizes, heads, vocabulary, tied embeddings, RoPE base), for
every model a shipped training config names; no download happens.
"""
from __future__ import annotations

from pathlib import Path

from car_jax.assets import shipped_models, smollm2_gguf
from car_jax.checkpoints.hub import parse_hub_id
from car_jax.checkpoints.sources import config_from_file, read_config
from car_jax.models.config import ModelConfig

__all__ = ["model_config", "shipped_models"]


def model_config(path: str) -> ModelConfig:
    """The ModelConfig for a policy path (module docstring). Raises FileNotFoundError naming
    the path and the shipped models when neither a checkpoint nor a shipped copy is found."""
    if not path:
        return read_config(smollm2_gguf())
    if Path(path).exists():
        return read_config(path)
    shipped = shipped_models()
    if (hub := parse_hub_id(path)) is not None:  # model.path=owner/name@REV: the shipped copy (of main) stands for the revision
        path = hub[0]
    if path in shipped:
        return config_from_file(shipped[path])
    by_name = {hub.split("/")[-1]: f for hub, f in shipped.items()}
    name = Path(path.rstrip("/")).name
    if name in by_name:
        return config_from_file(by_name[name])
    raise FileNotFoundError(
        f"model.path={path!r}: no checkpoint there and no shipped config.json for {name!r}; give a folder with "
        f"a config.json, or one of the shipped models: {', '.join(shipped) or '(none: car_jax/configs/models is missing)'}")
