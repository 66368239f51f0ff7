"""BERT encoder: parity with transformers' BertModel (torch, test-only oracle), the
safetensors conversion table, and the text-encoder wrapper (MiniLM, E5 prefixes)."""
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer, BertConfig, BertModel

from car_jax.checkpoints.bert import load_params, to_hf
from car_jax.models.encoder import embed, forward
from car_jax.tools.text_encoder import TextEncoder, minilm_path, resolve_encoder


def _tiny_bert(folder, seed=0, **overrides):
    cfg = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=37, max_position_embeddings=64, hidden_act="gelu")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**cfg), add_pooling_layer=True).eval()
    model.save_pretrained(folder)
    return model


def _torch_mean_pooled(hidden, mask):  # the sentence-transformers head
    m = mask[..., None].float()
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_tiny_random_bert_matches_transformers(tmp_path, act):
    model = _tiny_bert(tmp_path, hidden_act=act)
    params, cfg = load_params(tmp_path)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 99, size=(3, 11)).astype(np.int32)  # [B, T]
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # padded rows of different lengths
    mask[2, 3:] = 0
    ids = ids * mask
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask)).last_hidden_state
    ours = np.asarray(forward(params, ids, mask, cfg=cfg))
    keep = mask.astype(bool)
    np.testing.assert_allclose(ours[keep], ref.numpy()[keep], atol=1e-5, rtol=0)
    pooled = np.asarray(embed(params, ids, mask, cfg=cfg))
    np.testing.assert_allclose(pooled, _torch_mean_pooled(ref, torch.tensor(mask)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=-1), 1.0, atol=1e-6)


def test_conversion_round_trip_is_exact(tmp_path):
    _tiny_bert(tmp_path)
    params, cfg = load_params(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    back = to_hf(params, cfg)
    assert back, "empty conversion"
    for name, value in back.items():
        np.testing.assert_array_equal(value, stored[name], err_msg=name)
    unused = set(stored) - set(back)
    assert unused == {"pooler.dense.weight", "pooler.dense.bias"}  # ignored on purpose


def test_prefixed_names_are_accepted(tmp_path):
    _tiny_bert(tmp_path / "plain")
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    shutil.copy(tmp_path / "plain" / "config.json", prefixed)
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    tensors = {"bert." + k: v for k, v in tensors.items()}
    tensors["cls.predictions.bias"] = np.zeros(99, np.float32)  # a task head, ignored
    save_file(tensors, str(prefixed / "model.safetensors"))
    a, _ = load_params(tmp_path / "plain")
    b, _ = load_params(prefixed)
    np.testing.assert_array_equal(a["layer_1"]["attn"]["q_kernel"], b["layer_1"]["attn"]["q_kernel"])


def test_missing_or_misshapen_tensor_names_itself(tmp_path):
    _tiny_bert(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    name = "encoder.layer.1.attention.self.key.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path)
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.attention\.self\.key\.weight.*\(32, 32\)"):
        load_params(tmp_path)
    tensors[name] = np.zeros((32, 31), np.float32)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"shape \(32, 31\), expected \(32, 32\)"):
        load_params(tmp_path)


MINILM_TEXTS = [
    "Paris is the capital and largest city of France.",
    "",
    "東京は日本の首都です。 Тест по-русски.",
    "how many squares are on a chess board " * 80,  # > 256 tokens: truncated
]


def test_shipped_minilm_matches_transformers():
    spec = resolve_encoder()
    assert spec.name == "all-MiniLM-L6-v2" and spec.max_length == 256 and spec.query_prefix == ""
    enc = TextEncoder(spec, batch_size=4)
    ours = enc.encode(MINILM_TEXTS)
    tok = AutoTokenizer.from_pretrained(spec.path)
    model = BertModel.from_pretrained(spec.path).eval()
    batch = tok(MINILM_TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert enc.tokenize(MINILM_TEXTS) == [
        ids[m == 1].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])
    ]
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    ref = _torch_mean_pooled(hidden, batch["attention_mask"])
    assert ours.shape == (4, 384) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= 1e-4


def test_e5_folder_gets_prefixes(tmp_path):
    folder = tmp_path / "e5-tiny"
    _tiny_bert(folder, vocab_size=30522, max_position_embeddings=512)
    shutil.copy(minilm_path() / "tokenizer.json", folder)
    spec = resolve_encoder(str(folder))
    assert (spec.query_prefix, spec.passage_prefix, spec.max_length) == ("query: ", "passage: ", 512)
    enc = TextEncoder(spec)
    np.testing.assert_allclose(enc.encode_queries(["who wrote hamlet"]), enc.encode(["query: who wrote hamlet"]))
    np.testing.assert_allclose(enc.encode_passages(["Hamlet"]), enc.encode(["passage: Hamlet"]))
    assert resolve_encoder(str(folder), query_prefix="").query_prefix == ""
    with pytest.raises(FileNotFoundError, match="neither 'minilm' nor an HF folder"):
        resolve_encoder(str(tmp_path / "nowhere"))


def test_core_modules_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import car_jax.models.encoder, car_jax.checkpoints.bert, car_jax.tools.index, "
            "car_jax.tools.server, car_jax.tools.http_client, car_jax.tools.python_tool\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
