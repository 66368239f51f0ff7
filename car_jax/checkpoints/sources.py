"""What a checkpoint path holds: its model config and its tokenizer.

A path is a `.gguf` file, an HF folder (config.json + safetensors), or a car_jax params
folder (config.json + orbax params, `checkpoints.convert`); all three carry a config and
usually a tokenizer.
"""
from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer

from car_jax.checkpoints.gguf_io import GGUFFile, gguf_tokenizer
from car_jax.checkpoints.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError, read_json
from car_jax.models.config import ConfigFieldError, ModelConfig, UnsupportedConfigError


PARAMS_MARKER = "car_jax_params.json"  # marks a car_jax params folder (`checkpoints.convert`)
KINDS = "an HF folder (config.json + safetensors), a .gguf file or a car_jax params folder"


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def check_model_path(path: str | os.PathLike) -> None:
    """Raises CheckpointError, naming what is missing, unless `path` holds a model: a .gguf
    file, or a folder with a config.json and weights (safetensors or a car_jax params
    folder). Reads no weights: a check to make before a tokenizer or a model loads."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give {KINDS}")
    if is_gguf(path):
        return
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file but not a .gguf file; give {KINDS}")
    weights = (SINGLE_NAME, INDEX_NAME, PARAMS_MARKER)
    missing = [what for what, ok in (("config.json", (path / "config.json").is_file()),
                                     (f"weights ({', '.join(weights)})", any((path / w).is_file() for w in weights)))
               if not ok]
    if missing:
        raise CheckpointError(f"{path} holds no model: no {' and no '.join(missing)}; give {KINDS}")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a .gguf file or of a folder with a config.json.

    Raises CheckpointError naming the path when it does not exist or holds no config, and
    naming the file (and field) when config.json is not JSON or a field has the wrong kind
    of value; UnsupportedConfigError (with the file named) for what car_jax does not compute.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give {KINDS}")
    if is_gguf(path):
        return GGUFFile(path).config
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} holds no model: not a .gguf file and no config.json in it; give {KINDS}")
    return config_from_file(cfg_file)


def config_from_file(cfg_file: Path) -> ModelConfig:
    """ModelConfig.from_hf of a config.json file; its errors name the file."""
    hf = read_json(cfg_file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object of config fields, got {type(hf).__name__}")
    try:
        return ModelConfig.from_hf(hf)
    except ConfigFieldError as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None
    except UnsupportedConfigError as err:
        raise UnsupportedConfigError(f"{cfg_file}: {err}") from None


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer, with its chat template, from an HF folder or `.gguf` file.
    Padding goes on the left (the rollout engine's layout); a missing pad token is set
    to the EOS token."""
    path = Path(path)
    tok = gguf_tokenizer(GGUFFile(path)) if is_gguf(path) else AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
