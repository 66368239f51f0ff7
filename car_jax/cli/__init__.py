"""The `car-jax` entry point. Each sub-command lives in the module that owns its logic;
a module listed here exposes `register(subparsers)` which adds its parsers and sets
`func(args) -> int` on them.

A bad config (`car_jax.config.ConfigError`: an unknown key, a wrong type, a value out of
range, a missing --config file, more mesh devices than there are, an incomplete
multi-process environment: `car_jax/cli/distributed.py`) ends any command with
one line on stderr, `car-jax train: error: rl.steps: -3 must be >= 1 ...`, and exit
status 2, as argparse does for bad arguments. Configs are checked before any model loads."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

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


def load_config_args(cls, args):
    """`config.load_config(cls, args.config, args.overrides)`; a bad file or key raises
    ConfigError (a missing --config file too), which `main` prints as one line naming it."""
    try:
        return load_config(cls, args.config, args.overrides)
    except FileNotFoundError as err:
        raise ConfigError(f"--config: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="car-jax", description=__doc__.splitlines()[0])
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
        maybe_init_distributed()  # several processes: joined before anything touches a device
        enable_compilation_cache()
        return int(args.func(args) or 0)
    except ConfigError as err:
        message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"car-jax {args.command}: error: {message}", file=sys.stderr)
        return 2
