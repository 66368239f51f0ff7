"""A bad checkpoint or an unsupported config fails with the tensor or field named."""
import json
import re

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


# ---------------------------------------------------------------- damaged files, bad fields
def _hf_folder(path, config=BASE):
    """A folder with a config.json and a (small, valid) model.safetensors: enough for
    load_model to reach the check under test, which comes before any weight is read."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": np.ones(8, np.float32), "model.embed_tokens.weight": np.ones((8, 8), np.float32)},
              path / "model.safetensors")
    return path


@pytest.mark.parametrize("keep", [5, 100, 0.5])  # header too small, header length past the end, data cut
def test_truncated_safetensors_names_the_file(tmp_path, keep):
    folder = _hf_folder(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model(folder)
    assert str(folder / "model.safetensors") in str(e.value) and "truncated" in str(e.value)


def test_truncated_shard_names_the_shard(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    files = write_safetensors(sorted(tensors.items()), folder, max_shard_bytes=40)
    assert len(files) == 2
    shard = folder / files[1]
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=re.escape(str(shard))):
        car_jax.load_model(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_invalid_json_names_the_file_and_the_place(tmp_path, name):
    folder = _hf_folder(tmp_path / "m")
    (folder / name).write_text('{"model_type": "llama",\n "vocab_size": 8,,}')
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model(folder)
    assert str(folder / name) in str(e.value) and "line 2 column 18" in str(e.value)


def test_index_without_a_weight_map(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*weight_map"):
        car_jax.load_model(folder)


@pytest.mark.parametrize("name", ["nope", "nope.gguf"])
def test_missing_path_does_not_exist(tmp_path, name):
    from car_jax.checkpoints.convert import convert

    for load in (car_jax.load_model, lambda p: convert(p, tmp_path / "out")):
        with pytest.raises(CheckpointError) as e:
            load(tmp_path / name)
        assert f"{tmp_path / name} does not exist" in str(e.value) and "no config.json" not in str(e.value)


@pytest.mark.parametrize("edit, field, expected", [
    ({"hidden_size": "32"}, "hidden_size='32' (str)", "a positive integer"),
    ({"num_hidden_layers": None}, "num_hidden_layers is missing", "a positive integer"),
    ({"vocab_size": -8}, "vocab_size=-8", "a positive integer"),
    ({"intermediate_size": 8.5}, "intermediate_size=8.5 (float)", "a positive integer"),
    ({"num_attention_heads": True}, "num_attention_heads=True (bool)", "a positive integer"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads='2'", "a positive integer"),
    ({"head_dim": 0}, "head_dim=0", "a positive integer"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' (str)", "a positive number"),
    ({"rope_theta": "1e4"}, "rope_theta='1e4'", "a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_parameters.rope_theta='1e4'",
     "a positive number"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' (str)", "an object"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' (str)", "true or false"),
    ({"attention_bias": 1}, "attention_bias=1 (int)", "true or false"),
    ({"bos_token_id": "1"}, "bos_token_id='1'", "a token id"),
    ({"eos_token_id": [2, "3"]}, "eos_token_id[1]='3'", "a token id"),
    ({"eos_token_id": -1}, "eos_token_id=-1", "a token id"),
])
def test_config_field_of_the_wrong_kind_names_file_field_and_expectation(tmp_path, edit, field, expected):
    config = {k: v for k, v in {**BASE, **edit}.items() if v is not None}
    folder = _hf_folder(tmp_path / "m", config)
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model(folder)
    msg = str(e.value)
    assert msg.startswith(f"{folder / 'config.json'}: field {field}") and expected in msg, msg


def test_config_json_that_is_not_an_object(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / 'config.json'}: expected a JSON object")):
        car_jax.load_model(folder)


def test_unsupported_config_from_a_file_names_it(tmp_path):
    folder = _hf_folder(tmp_path / "m", {**BASE, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedConfigError, match=re.escape(f"{folder / 'config.json'}: hidden_act='gelu'")):
        car_jax.load_model(folder)


def test_field_checks_keep_valid_values():
    """Integers stay ints (a JSON float like 32.0 is refused above), defaults fill nulls."""
    cfg = ModelConfig.from_hf({**BASE, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1,
                               "eos_token_id": [2, 3], "bos_token_id": 0, "rope_theta": 500000})
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.eos_token_id, cfg.bos_token_id) == (2, 4, (2, 3), 0)
    assert cfg.norm_eps == 1.0 and type(cfg.norm_eps) is float and cfg.rope_theta == 5e5


# ---------------------------------------------------------------- non-finite weights, fields out of range
@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_names_the_tensor(folder, name, bad):
    def poison(t):
        t[name] = t[name].copy()
        t[name].flat[3] = bad
    _rewrite(folder, poison)
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model(folder)
    msg = str(e.value)
    assert msg.startswith(f"{folder}: tensor {name!r} holds NaN or inf") and "\n" not in msg, msg


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_weight_that_overflows_the_storage_dtype(folder):
    _rewrite(folder, lambda t: t["model.layers.0.self_attn.k_proj.weight"].__setitem__((0, 0), 1e5))
    car_jax.load_model(folder)  # finite in float32
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' holds NaN or inf.*"
                                              r"float16.*load it in float32"):
        car_jax.load_model(folder, dtype="float16")


def test_non_finite_params_folder_names_the_tensor(folder, tmp_path):
    from car_jax.checkpoints.convert import save_params

    model = car_jax.load_model(folder)
    params = {**model.params, "layers": {**model.params["layers"], "input_norm":
                                         model.params["layers"]["input_norm"].at[1, 0].set(np.nan)}}
    save_params(params, model.config, tmp_path / "params")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'params'}: tensor "
                                                        f"'model.layers.1.input_layernorm.weight' holds NaN")):
        car_jax.load_model(tmp_path / "params")


@pytest.mark.parametrize("edit, message", [
    ({"rope_theta": -10000}, "field rope_theta=-10000 (int): expected a positive number"),
    ({"rope_theta": float("inf")}, "field rope_theta=inf: expected a positive finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "field rope_theta=inf: expected a positive finite number"),
    ({"rms_norm_eps": float("inf")}, "field rms_norm_eps=inf: expected a positive finite number"),
    ({"rms_norm_eps": 1e300}, "field rms_norm_eps=1e+300: expected a positive finite number"),
    ({"rms_norm_eps": float("nan")}, "field rms_norm_eps=nan (float): expected a positive number"),
    ({"hidden_size": 9}, "field hidden_size=9 is not a multiple of num_attention_heads=2"),
    ({"hidden_size": 1}, "field hidden_size=1 is not a multiple of num_attention_heads=2"),
    ({"head_dim": 3}, "field head_dim=3: expected an even number"),
    ({"vocab_size": 2**40}, "field vocab_size=1099511627776: expected a positive integer below 2^31"),
    ({"max_position_embeddings": 2**31}, "field max_position_embeddings=2147483648: expected a positive integer"),
])
def test_config_field_out_of_range_names_file_and_field(tmp_path, edit, message):
    folder = _hf_folder(tmp_path / "m", {**BASE, **edit})  # json writes inf as Infinity, nan as NaN
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model(folder)
    assert str(e.value).startswith(f"{folder / 'config.json'}: {message}"), str(e.value)


def test_config_made_in_code_checks_its_ranges():
    import dataclasses

    cfg = ModelConfig.from_hf(BASE)
    for field, value, key in [("rope_theta", -1e4, "rope_theta"), ("norm_eps", 0.0, "rms_norm_eps"),
                              ("n_layers", 0, "num_hidden_layers"), ("mlp_dim", 2**31, "intermediate_size")]:
        with pytest.raises(ValueError, match=f"field {key}="):
            dataclasses.replace(cfg, **{field: value})
