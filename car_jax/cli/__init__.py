"""The `car-jax` entry point. Each sub-command lives in the module that owns its logic;
a module listed here exposes `register(subparsers)` which adds its parsers and sets
`func(args) -> int` on them.

A bad config (`car_jax.config.ConfigError`: an unknown key, a wrong type, a value out of
range, a missing --config file, more mesh devices than there are, an incomplete
multi-process environment: `car_jax/cli/distributed.py`) ends any command with
one line on stderr, `car-jax train: error: rl.steps: -3 must be >= 0 ...`, and exit
status 2, as argparse does for bad arguments; so does a missing offline asset package
(`car_jax.assets.MissingAssetError`, naming `car-jax assets`). Configs are checked before
any model loads. `--config configs/X.yaml` that names no file where the command runs reads
the copy shipped inside the package (`car_jax.assets.resolve_config`), so the README's
commands work from a pip install too."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from car_jax.assets import MissingAssetError
from car_jax.cli.distributed import maybe_init_distributed
from car_jax.config import ConfigError, load_config

# modules that contribute sub-commands, imported only when the CLI starts
COMMAND_MODULES = (
    "car_jax.cli.convert",  # convert
    "car_jax.cli.run",  # run
    "car_jax.cli.tools",  # build-index, serve-retriever
    "car_jax.cli.train",  # train
    "car_jax.cli.eval",  # eval
    "car_jax.cli.pilot",  # pilot
    "car_jax.cli.plan",  # plan
    "car_jax.cli.experiment",  # experiment
    "car_jax.cli.control",  # control
    "car_jax.cli.assets",  # assets
)


def enable_compilation_cache(min_seconds: float = 1.0) -> str | None:
    """Keeps compiled XLA programs on disk, so a second run (or `eval` after `train`)
    loads its decode loop and train step instead of compiling them again (a 30-layer
    decode loop takes ~7 s to compile on CPU and 30-60 s on a GPU). The folder is
    $CAR_JAX_XLA_CACHE, else `xla/` in the car_jax cache; CAR_JAX_XLA_CACHE=off turns
    it off. Returns the folder used, or None."""
    from car_jax.assets import cache_dir
    folder = os.environ.get("CAR_JAX_XLA_CACHE") or str(cache_dir() / "xla")
    if folder.lower() == "off":
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    return folder


def add_config_args(parser: argparse.ArgumentParser, what: str, example: str) -> None:
    """The `[--config X.yaml] [key=value ...]` arguments of a config-driven sub-command."""
    parser.add_argument("--config", default=None, help=f"YAML config ({what}); omitted: all defaults")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


def config_path(args) -> str | None:
    """--config as given, or the shipped copy it names when no such file exists here
    (`configs/qwen2.5-3b_car_mscr.yaml` outside a clone); None without --config."""
    from car_jax.assets import resolve_config
    return resolve_config(args.config) if args.config is not None else None


def load_config_args(cls, args):
    """`config.load_config(cls, config_path(args), args.overrides)`; a bad file or key raises
    ConfigError (a missing --config file too), which `main` prints as one line naming it."""
    try:
        return load_config(cls, config_path(args), args.overrides)
    except FileNotFoundError as err:
        raise ConfigError(f"--config: {err}") from None


def package_version() -> str:
    """The installed car_jax's version (its distribution metadata); the source's
    `car_jax.__version__` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("car_jax")
    except PackageNotFoundError:
        import car_jax
        return car_jax.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="car-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=package_version(),
                        help="print the installed car_jax version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a command module not written yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "starts_jax", True):  # `car-jax assets` only runs pip
            maybe_init_distributed()  # several processes: joined before anything touches a device
            enable_compilation_cache()
        return int(args.func(args) or 0)
    except (ConfigError, MissingAssetError) as err:
        message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"car-jax {args.command}: error: {message}", file=sys.stderr)
        return 2
