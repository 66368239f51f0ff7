"""`car-jax convert` in all three directions, and loading what it writes."""
import numpy as np
import transformers

import car_jax
from car_jax.cli import main
from tests.hf_factory import build, hf_logits


def test_convert_hf_to_params_and_back(tmp_path, capsys):
    torch_model = build("qwen3", tmp_path / "hf")
    assert main(["convert", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "params")]) == 0
    assert "hf -> car_jax params" in capsys.readouterr().out
    tokens = np.random.default_rng(0).integers(0, 96, size=(2, 7))
    ref = hf_logits(torch_model, tokens)
    # a params folder loads straight into car_jax, sharded or not
    assert np.abs(np.asarray(car_jax.load_model(tmp_path / "params").logits(tokens)) - ref).max() <= 1e-4
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    sharded = car_jax.load_model(tmp_path / "params", mesh=mesh)
    assert sharded.params["layers"]["attn"]["q"].sharding.spec == car_jax.sharding.spec_for(
        car_jax.sharding.PARAM_AXES["layers/attn/q"])
    assert np.abs(np.asarray(sharded.logits(tokens)) - ref).max() <= 1e-4
    # and back to an HF folder that transformers reads
    assert main(["convert", "--src", str(tmp_path / "params"), "--dst", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert np.abs(hf_logits(back, tokens) - ref).max() <= 1e-5


def test_convert_gguf_to_hf(tmp_path):
    from car_jax.assets import smollm2_gguf
    assert main(["convert", "--src", str(smollm2_gguf()), "--dst", str(tmp_path / "smol")]) == 0
    files = {p.name for p in (tmp_path / "smol").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    tok = car_jax.load_tokenizer(tmp_path / "smol")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def test_convert_rejects_unknown_source(tmp_path, capsys):
    assert main(["convert", "--src", str(tmp_path), "--dst", str(tmp_path / "x")]) == 2  # one line, exit 2
    err = capsys.readouterr().err
    assert err.startswith(f"car-jax convert: error: --src: {tmp_path}: not a .gguf file") and err.count("\n") == 1
