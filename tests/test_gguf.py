"""The embedded SmolLM2 GGUF: our dequantization + unpermutation equals transformers'."""
import functools
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
import transformers

import car_jax
from car_jax.assets import smollm2_gguf
from car_jax.checkpoints.gguf_io import unpermute_rows
from car_jax.loading import Model
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN

TEXTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
         "The quick brown fox jumps over the lazy dog. </search>\n\n<answer>"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's forwards on one thread: a 135M model over 32 tokens is a fraction of a second
    of work, and its thread pool spinning on a busy machine costs several times that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loading of model and tokenizer. It parses the file's metadata
    (the whole 49k-token vocabulary) with a new `gguf.GGUFReader` three times (tokenizer,
    config, weights) and builds gguf's tensor-name table once per submodule; here both are
    built once and shared (read-only), so transformers dequantizes and maps the same tensors
    through the same code, once."""
    path = smollm2_gguf()
    with mock.patch("gguf.GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader)), \
            mock.patch("gguf.get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3 * 8, 5))
    # llama.cpp's converter: rows [n, 2, H/2] -> [n, H/2, 2]
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, 3), w)


def test_tokenizer_matches_transformers(reference):
    _, ref_tok = reference
    ours = car_jax.load_tokenizer(smollm2_gguf())
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref_tok(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # SmolLM2 splits digits one by one (llama.cpp pre-tokenizer "smollm")
    assert ours.convert_ids_to_tokens(ours("2024")["input_ids"]) == ["2", "0", "2", "4"]


def test_gguf_logits_match_transformers_gguf_loading(reference, smollm2_hf):
    ref_model, tok = reference
    batch = [tok(t)["input_ids"][:16] for t in TEXTS]
    tokens = np.array(batch)
    with torch.no_grad():
        ref = ref_model(torch.as_tensor(tokens)).logits.float().numpy()
    model = car_jax.load_model(smollm2_gguf())
    direct = np.asarray(model.logits(tokens))
    assert np.abs(direct - ref).max() <= 1e-3
    # the plain (accelerator) policy computes the same logits as the backend's, from the same
    # params (loading the GGUF a second time would read and dequantize the same bytes again)
    plain = np.asarray(Model(model.config, model.params, Decoder(model.config, policy=PLAIN)).logits(tokens))
    assert np.abs(plain - direct).max() <= 1e-4
    # the converted HF folder gives the same logits, in car_jax and in transformers
    via_hf = np.asarray(car_jax.load_model(smollm2_hf).logits(tokens))
    assert np.abs(via_hf - direct).max() <= 1e-5
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf).eval()
    with torch.no_grad():
        hf = hf_model(torch.as_tensor(tokens)).logits.float().numpy()
    assert np.abs(hf - ref).max() <= 1e-3
