"""LoRA exports: the merged HF folder (`save_hf_folder` of base + adapters) loads in
transformers with the logits of car_jax's LoRA forward, and the PEFT folder
(`checkpoints.peft`) holds lora_A [r, in] / lora_B [out, r] under PEFT's names, from which
W + (alpha / r) B_hf @ A_hf, re-derived in numpy, is the merged HF weight."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from car_jax import sharding as shd
from car_jax.checkpoints.loader import save_hf_folder
from car_jax.checkpoints.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_folder
from car_jax.loading import load_model
from car_jax.models import lora
from car_jax.models.config import LoraConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN
from tests.hf_factory import build, hf_logits

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def hf_weights(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def exported(request, tmp_path_factory):
    """A tiny HF model, random adapters on every target (B random, not zero), and both
    exports: (cfg, car_jax LoRA logits, tokens, base folder, merged folder, peft folder)."""
    root = tmp_path_factory.mktemp(request.param)
    build(request.param, root / "base")
    model = load_model(root / "base", policy=PLAIN)
    cfg = dataclasses.replace(model.config, lora=LoraConfig(rank=4, alpha=6.0))
    adapters = lora.init_adapters(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), jnp.float32), adapters)
    params = lora.join(model.params, adapters)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11))
    logits = np.asarray(Decoder(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32))[0])
    save_hf_folder(params, cfg, root / "merged")
    save_peft_folder(adapters, cfg, root / "peft", base_model=str(root / "base"))
    return cfg, logits, tokens, root / "base", root / "merged", root / "peft", adapters


def test_merged_export_loads_in_transformers_with_the_lora_logits(exported):
    cfg, logits, tokens, base, merged, _, _ = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(hf, tokens), logits, atol=1e-4)
    # the adapters matter: the base checkpoint's logits are elsewhere
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert np.abs(hf_logits(plain, tokens) - logits).max() > 1e-2


def test_peft_folder_rederives_the_merged_weights(exported):
    cfg, _, _, base, merged, peft, adapters = exported
    config = json.loads((peft / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 6.0
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    saved = load_file(str(peft / ADAPTER_WEIGHTS))
    names = {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
             for i in range(cfg.n_layers) for m in HF_MODULES.values() for ab in "AB"}
    assert set(saved) == names
    w_base, w_merged = hf_weights(base), hf_weights(merged)
    scale = 6.0 / 4
    for layer in range(cfg.n_layers):
        for target, m in HF_MODULES.items():
            prefix = f"model.layers.{layer}.{m}"
            a_hf = saved[f"base_model.model.{prefix}.lora_A.weight"]
            b_hf = saved[f"base_model.model.{prefix}.lora_B.weight"]
            out_dim, in_dim = w_base[prefix + ".weight"].shape
            assert a_hf.shape == (4, in_dim) and b_hf.shape == (out_dim, 4), prefix
            want = w_base[prefix + ".weight"].astype(np.float64) + scale * b_hf.astype(np.float64) @ a_hf
            np.testing.assert_allclose(w_merged[prefix + ".weight"], want, atol=1e-6, err_msg=prefix)
    # everything else is the base's, unchanged
    adapted = {f"model.layers.{i}.{m}.weight" for i in range(cfg.n_layers) for m in HF_MODULES.values()}
    assert set(w_merged) == set(w_base)
    for name in set(w_base) - adapted:
        assert np.array_equal(w_merged[name], w_base[name]), name
    # car_jax's own merge is the same
    flat = shd.flatten_params(lora.merge_lora(lora.join(load_model(base, policy=PLAIN).params, adapters), cfg))
    q = np.asarray(flat["layers/attn/q"][1])  # [D, N, H]
    np.testing.assert_allclose(q.reshape(q.shape[0], -1).T, w_merged["model.layers.1.self_attn.q_proj.weight"],
                               atol=1e-6)


def test_peft_export_of_some_targets(tmp_path):
    """Only the configured targets are exported and named in target_modules."""
    build("llama", tmp_path / "base")
    model = load_model(tmp_path / "base", policy=PLAIN)
    cfg = dataclasses.replace(model.config, lora=LoraConfig(rank=2, alpha=2.0, targets=("v", "down")))
    save_peft_folder(lora.init_adapters(cfg, jax.random.key(0)), cfg, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["v_proj", "down_proj"]
    saved = load_file(str(tmp_path / "peft" / ADAPTER_WEIGHTS))
    assert {k.split(".")[-3] for k in saved} == {"v_proj", "down_proj"} and len(saved) == 2 * 2 * cfg.n_layers
    with pytest.raises(ValueError, match="lora.rank=0"):
        save_peft_folder({}, model.config, tmp_path / "none")
