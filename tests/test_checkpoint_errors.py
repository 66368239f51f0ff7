"""A bad checkpoint or an unsupported config fails with the tensor or field named."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import car_jax
from car_jax.checkpoints.safetensors_io import CheckpointError, write_safetensors
from car_jax.models.config import ModelConfig, UnsupportedConfigError
from tests.hf_factory import build


@pytest.fixture()
def folder(tmp_path):
    build("llama", tmp_path / "m", tie_word_embeddings=False)
    return tmp_path / "m"


def _rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_wrong_shape(folder):
    _rewrite(folder, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((64, 31), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(64, 31\).*\(64, 32\)"):
        car_jax.load_model(folder)


def test_unknown_tensor(folder):
    _rewrite(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unknown tensor.*model\.layers\.0\.mlp\.extra\.weight"):
        car_jax.load_model(folder)


def test_missing_tensor(folder):
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight.*missing"):
        car_jax.load_model(folder)


def test_integer_dtype(folder):
    _rewrite(folder, lambda t: t.update({"model.norm.weight": np.ones(32, np.int8)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*int8"):
        car_jax.load_model(folder)


def test_missing_shard(folder, tmp_path):
    tensors = load_file(folder / "model.safetensors")
    sharded = tmp_path / "sharded"
    files = write_safetensors(sorted(tensors.items()), sharded, max_shard_bytes=20_000)
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").exists()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    # a complete sharded folder loads and gives the single-file logits
    tokens = np.arange(12).reshape(2, 6)
    np.testing.assert_allclose(car_jax.load_model(sharded).logits(tokens),
                               car_jax.load_model(folder).logits(tokens), atol=0, rtol=0)
    (sharded / files[1]).unlink()
    with pytest.raises(CheckpointError, match=files[1]):
        car_jax.load_model(sharded)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        car_jax.load_model(tmp_path)


BASE = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8}


@pytest.mark.parametrize("extra,field", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type='llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type='yarn'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen3_moe"}, "model_type='qwen3_moe'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "num_key_value_heads=3"),
])
def test_unsupported_config_names_the_field(extra, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig.from_hf({**BASE, **extra})


def test_config_round_trip():
    cfg = ModelConfig.from_hf({**BASE, "num_key_value_heads": 1, "rope_theta": 5e5, "attention_bias": True})
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
