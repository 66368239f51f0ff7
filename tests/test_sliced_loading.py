"""Sharded loading reads only the checkpoint bytes each process's devices hold.

The table maps a slice of a param to the rectangle of its HF tensor (checked against the
whole-tensor transforms written out in numpy); a load on a fake 8-device mesh equals the
whole-tensor load and reads every byte once; two real processes on loopback (4 CPU
devices each, one fsdp=8 mesh) each read about half the file, hold the right slices, and
save the checkpoint back with process 0 writing alone."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from car_jax.checkpoints.loader import load_params
from car_jax.checkpoints.safetensors_io import SafetensorsFolder
from car_jax.checkpoints.sources import read_config
from car_jax.checkpoints.table import entries, hf_names
from car_jax.models.config import ModelConfig
from car_jax.sharding import flatten_params, make_mesh
from tests.hf_factory import build
from tests.multihost import run_processes, succeeded

# d_model 128 so that weights, split over fsdp, outweigh the replicated norms and biases;
# 8 heads and 4 kv heads of 16 divide over tp=4
SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4)
MODELS = {"qwen2": {}, "qwen3": dict(tie_word_embeddings=False), "llama_bias": {}}  # qkv bias; qk norm; o/mlp bias


def _old_to_jax(path: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """The whole-tensor transforms as written before layouts: the independent reference."""
    leaf = path.split("/")[-1]
    if leaf in ("q", "k", "v"):
        return w.T.reshape(c.d_model, -1, c.head_dim)
    if leaf == "o":
        return w.T.reshape(-1, c.head_dim, c.d_model)
    if leaf in ("q_bias", "k_bias", "v_bias"):
        return w.reshape(-1, c.head_dim)
    if leaf in ("lm_head", "gate", "up", "down"):
        return w.T
    return w


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder, **SIZE, **MODELS[request.param])
    return folder


# the head_dim axis of the params whose HF rows are heads of H
HEAD_DIM_AXIS = {"q": 2, "k": 2, "v": 2, "o": 1, "q_bias": 1, "k_bias": 1, "v_bias": 1}


def _reference(folder: Path, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], int]:
    """{param path: whole param} from the file with numpy, and the bytes of the tensors placed."""
    tensors = load_file(folder / "model.safetensors")
    out, total = {}, 0
    for e in entries(cfg):
        names = hf_names(e, cfg)
        total += sum(tensors[n].nbytes for n in names)
        one = [_old_to_jax(e.path, tensors[n], cfg) for n in names]
        out[e.path] = np.stack(one) if e.stacked else one[0]
    return out, total


def _random_slice(rng, n: int) -> slice:
    lo = int(rng.integers(0, n))
    return slice(lo, int(rng.integers(lo + 1, n + 1)))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_every_param_slice_maps_to_the_smallest_hf_rectangle(model_type):
    cfg = ModelConfig.from_hf(dict(model_type=model_type, vocab_size=24, hidden_size=12, intermediate_size=20,
                                   num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3,
                                   head_dim=4, attention_bias=True, mlp_bias=True))
    rng = np.random.default_rng(0)
    for e in entries(cfg):
        w = rng.standard_normal(e.hf_shape(cfg)).astype(np.float32)
        whole = _old_to_jax(e.path, w, cfg)
        np.testing.assert_array_equal(e.to_jax(w, cfg), whole)
        np.testing.assert_array_equal(e.to_hf(whole, cfg), w)
        for _ in range(40):
            ix = tuple(_random_slice(rng, n) for n in whole.shape)
            rect = e.hf_index(ix, cfg)
            np.testing.assert_array_equal(e.slice_to_jax(w[rect], ix, cfg), whole[ix], err_msg=f"{e.path} {ix}")
            read, wanted = w[rect].size, whole[ix].size
            axis = HEAD_DIM_AXIS.get(e.path.split("/")[-1])
            if axis is None or ix[axis] == slice(0, cfg.head_dim):
                assert read == wanted, f"{e.path} {ix} reads {read} values for {wanted}"
            else:  # part of each head: the covering rows, more than it keeps, fewer than whole heads
                assert wanted <= read <= whole[ix[:axis]].size, f"{e.path} {ix} reads {read} values"
    q = next(e for e in entries(cfg) if e.path == "layers/attn/q")  # heads 1..3 are rows H..3H
    assert q.hf_index((slice(2, 5), slice(1, 3), slice(None)), cfg) == (slice(4, 12), slice(2, 5))
    assert q.hf_index((slice(None), slice(1, 3), slice(1, 2)), cfg) == (slice(5, 10), slice(0, 12))


@pytest.mark.parametrize("mode", ["train", "sample"])
@pytest.mark.parametrize("fsdp, tp", [(8, 1), (4, 2), (2, 4)])
def test_sliced_load_on_a_mesh_equals_the_whole_tensor_load(checkpoint, fsdp, tp, mode):
    cfg = read_config(checkpoint)
    reference, total = _reference(checkpoint, cfg)
    plain = flatten_params(load_params(SafetensorsFolder(checkpoint), cfg, progress=False))
    source = SafetensorsFolder(checkpoint)
    mesh = make_mesh(fsdp, tp)
    loaded = flatten_params(load_params(source, cfg, mesh=mesh, mode=mode, progress=False))
    assert loaded.keys() == reference.keys() == plain.keys()
    for path, want in reference.items():
        np.testing.assert_array_equal(np.asarray(plain[path]), want, err_msg=path)
        np.testing.assert_array_equal(np.asarray(loaded[path]), want, err_msg=path)
        assert loaded[path].sharding.mesh.shape == mesh.shape
    # one process holds every tile of every param: each byte is read once
    assert source.bytes_read == total


class DictSource:
    """A source that reads only whole tensors (as GGUF does)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors, self.reads = tensors, []

    def names(self):
        return list(self.tensors)

    def get(self, name):
        self.reads.append(name)
        return self.tensors[name]


def test_a_source_without_slices_reads_each_tensor_once(checkpoint):
    cfg = read_config(checkpoint)
    reference, _ = _reference(checkpoint, cfg)
    source = DictSource(load_file(checkpoint / "model.safetensors"))
    loaded = flatten_params(load_params(source, cfg, mesh=make_mesh(2, 4), progress=False))
    for path, want in reference.items():
        np.testing.assert_array_equal(np.asarray(loaded[path]), want, err_msg=path)
    assert sorted(source.reads) == sorted(n for e in entries(cfg) for n in hf_names(e, cfg))


# ---------------------------------------------------------------- two real processes
WORKER = """
import json, sys
import jax
from car_jax.cli import maybe_init_distributed
assert maybe_init_distributed()
folder, out = sys.argv[1], sys.argv[2]
rank = jax.process_index()
import numpy as np
from safetensors.numpy import load_file
from car_jax.checkpoints.loader import load_params, save_hf_folder
from car_jax.checkpoints.safetensors_io import SafetensorsFolder
from car_jax.checkpoints.sources import read_config
from car_jax.checkpoints.table import entries, hf_names
from car_jax.sharding import flatten_params, make_mesh

assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
cfg = read_config(folder)
source = SafetensorsFolder(folder)
params = load_params(source, cfg, mesh=make_mesh(8, 1, jax.devices()), progress=False)
bytes_read = source.bytes_read
tensors = load_file(f"{folder}/model.safetensors")
shards = 0
for e in entries(cfg):
    whole = [e.to_jax(tensors[n], cfg) for n in hf_names(e, cfg)]
    whole = np.stack(whole) if e.stacked else whole[0]
    x = flatten_params(params)[e.path]
    assert not x.is_fully_addressable, e.path  # the global array spans both processes
    for shard in x.addressable_shards:
        assert shard.device.process_index == rank
        np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index], err_msg=e.path)
        shards += 1
save_hf_folder(params, cfg, f"{out}/process{rank}")
print("RESULT " + json.dumps({"rank": rank, "bytes_read": bytes_read, "shards": shards}), flush=True)
"""


def test_two_processes_each_read_their_half_and_process_0_saves(tmp_path):
    folder = tmp_path / "ckpt"
    build("qwen2", folder, **SIZE)
    cfg = read_config(folder)
    tensors = load_file(folder / "model.safetensors")
    total = sum(tensors[n].nbytes for e in entries(cfg) for n in hf_names(e, cfg))
    outputs = run_processes([sys.executable, "-c", WORKER, str(folder), str(tmp_path)], processes=2, devices=4,
                            timeout=180)
    succeeded(outputs)
    results = [json.loads(out.split("RESULT ", 1)[1]) for _, out, _ in outputs]
    print("total tensor bytes", total, "read per process", [r["bytes_read"] for r in results])
    for r in results:
        assert r["shards"] == 4 * len(entries(cfg))  # each of its 4 devices holds a slice of every param
        assert 0.4 * total < r["bytes_read"] <= 0.6 * total, (r, total)
    # process 0 wrote the checkpoint back, equal to the source; process 1 wrote nothing
    assert not (tmp_path / "process1").exists()
    saved = load_file(tmp_path / "process0" / "model.safetensors")
    assert saved.keys() == {n for e in entries(cfg) for n in hf_names(e, cfg)}
    for name, array in saved.items():
        np.testing.assert_array_equal(array, tensors[name], err_msg=name)
    assert read_config(tmp_path / "process0") == cfg
