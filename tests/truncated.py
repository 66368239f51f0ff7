"""The embedded SmolLM2-135M-Instruct cut to two of its 30 layers: the real embedding,
tokenizer, chat template and blocks at a fifteenth of the depth. Parity and plumbing checks
run on it, where the other layers add nothing but compile time (the XLA:CPU policy unrolls
the layers, so its compiles grow with depth); the end-to-end checks of what users run keep
the whole model.

It keeps the first and the last layer: the first layers alone decode one token over and
over within a few steps, which would leave a greedy parity check little to compare, while
first + last sample varied tokens with clear margins between the top two logits.

A test module imports the fixture (`from tests.truncated import smollm2_short`); it is
built once per session from conftest's converted folder (`smollm2_hf`).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Sequence

import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

KEEP = (0, 29)  # layer indices of the 30 kept, in order
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def keep_layers(src: Path, dst: Path, keep: Sequence[int]) -> Path:
    """Writes the HF folder `src` with only layers `keep` (renumbered 0..len(keep)-1, in
    that order) into `dst`; the tokenizer files are copied as they are. Returns dst."""
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    if not keep or sorted(set(keep)) != list(keep) or not 0 <= keep[0] <= keep[-1] < n:
        raise ValueError(f"keep={keep} must be increasing layer indices in 0..{n - 1}")
    if not (src / "model.safetensors").is_file():
        raise ValueError(f"{src} has no single model.safetensors (a sharded checkpoint?)")
    new_index = {str(old): str(new) for new, old in enumerate(keep)}
    tensors = {}
    with safe_open(src / "model.safetensors", "np") as f:
        for name in f.keys():
            m = _LAYER.fullmatch(name)
            if m is None:
                tensors[name] = f.get_tensor(name)
            elif m.group(1) in new_index:
                tensors[f"model.layers.{new_index[m.group(1)]}.{m.group(2)}"] = f.get_tensor(name)
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": len(keep)}, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    return dst


@pytest.fixture(scope="session")
def smollm2_short(smollm2_hf, tmp_path_factory) -> Path:
    """An HF folder: the embedded SmolLM2 with only its layers KEEP (see the module doc)."""
    return keep_layers(Path(smollm2_hf), tmp_path_factory.mktemp("smollm2_short") / "hf", KEEP)
