"""Reading and writing Hugging Face safetensors folders, one tensor at a time."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: the message names the tensor or file."""


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON file at `path` (config.json, an index); a file that is not JSON
    text is a CheckpointError naming it and where the parser stopped."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                              f"the file is damaged or truncated: re-download or re-export it") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 JSON text (a binary file under this name?)") from None


def open_safetensors(path: Path):
    """`safe_open(path, "numpy")`, which reads the header; a file safetensors cannot read
    (truncated, not safetensors at all) is a CheckpointError naming it."""
    try:
        return safe_open(path, "numpy")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); it is damaged or "
                              f"truncated: re-download or re-export it") from None


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsFolder:
    """The tensors of an HF folder (single file or sharded with an index), read lazily.

    `get(name)` opens the shard, copies out that one tensor and closes the file again,
    so no more than one tensor's pages stay mapped at a time; `get_slice(name, index)`
    copies out only a rectangle of it (the bytes one process's devices hold), and
    `shape(name)` reads only the header. `bytes_read` sums the bytes of every array
    returned so far (what a multi-process load reads in each process).
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.bytes_read = 0
        index = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        if index.exists():
            data = read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index}: expected a JSON object whose \"weight_map\" maps each "
                                      f"tensor name to its shard file")
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).exists()})
            if missing:
                names = [n for n, f in weight_map.items() if f == missing[0]][:3]
                raise CheckpointError(
                    f"{index}: shard file(s) {missing} missing (they hold {names}...); "
                    f"re-download or re-export the checkpoint")
            self._where = {name: self.folder / f for name, f in weight_map.items()}
            for shard in sorted(set(self._where.values())):  # headers only: a damaged shard fails now
                open_safetensors(shard)
        elif single.exists():
            with open_safetensors(single) as f:
                self._where = {name: single for name in f.keys()}
        else:
            raise CheckpointError(f"{self.folder}: neither {SINGLE_NAME} nor {INDEX_NAME} found")

    def names(self) -> list[str]:
        return list(self._where)

    def _file(self, name: str) -> Path:
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} missing from the checkpoint")
        return self._where[name]

    def _read(self, name: str, read: Callable[[Any], np.ndarray]) -> np.ndarray:
        path = self._file(name)
        with open_safetensors(path) as f:
            try:
                out = read(f)
            except (TypeError, ValueError, SafetensorError) as err:  # e.g. a dtype numpy cannot represent
                raise CheckpointError(f"{path}: tensor {name!r} cannot be read: {err}") from err
        self.bytes_read += out.nbytes
        return out

    def get(self, name: str) -> np.ndarray:
        """The whole tensor `name`."""
        return self._read(name, lambda f: np.array(f.get_tensor(name)))

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the rectangle `index` (step-1 slices, one per axis) of tensor `name`."""
        return self._read(name, lambda f: np.asarray(f.get_slice(name)[tuple(index)]))

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the file header (no data is read)."""
        with open_safetensors(self._file(name)) as f:
            return tuple(f.get_slice(name).get_shape())


def write_safetensors(tensors: Iterable[tuple[str, np.ndarray]], folder: str | os.PathLike,
                      max_shard_bytes: int = 2 << 30) -> list[str]:
    """Writes (name, array) pairs as shards of at most `max_shard_bytes` (one tensor may
    exceed it), with an index when there is more than one shard. Arrays are consumed as
    they come, so only one shard is in memory at a time. Returns the file names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush(shard: dict[str, np.ndarray]):
        name = f"model-{len(files) + 1:05d}.safetensors.tmp"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})

    current: dict[str, np.ndarray] = {}
    size = 0
    for name, array in tensors:
        array = np.ascontiguousarray(array)
        if current and size + array.nbytes > max_shard_bytes:
            flush(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current:
        flush(current)

    total = len(files)
    final = [SINGLE_NAME] if total == 1 else [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    for tmp, dst in zip(files, final):
        os.replace(folder / tmp, folder / dst)
    if total > 1:
        rename = dict(zip(files, final))
        index = {"metadata": {}, "weight_map": {k: rename[v] for k, v in weight_map.items()}}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return final
