"""`car-jax convert`: checkpoint conversion, direction inferred from the source."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert GGUF -> HF, HF -> car_jax params, car_jax params -> HF")
    p.add_argument("--src", required=True, help=".gguf file, HF folder, car_jax params folder, or a hub id "
                                                "(owner/name[@revision], fetched into the HF cache)")
    p.add_argument("--dst", required=True, help="output folder")
    p.add_argument("--dtype", default="float32", help="param dtype when reading an HF folder")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from car_jax.checkpoints.convert import convert
    from car_jax.checkpoints.hub import resolve_model_path
    from car_jax.checkpoints.safetensors_io import CheckpointError
    from car_jax.config import ConfigError
    from car_jax.models.config import UnsupportedConfigError

    try:
        direction, out = convert(resolve_model_path(args.src), args.dst, args.dtype)
    except (CheckpointError, UnsupportedConfigError) as err:  # a missing or damaged source: one line, exit 2
        raise ConfigError(f"--src: {err}") from None
    print(f"{direction}: wrote {out}")
    return 0
