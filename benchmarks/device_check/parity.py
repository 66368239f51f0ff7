"""Section parity: car_jax against transformers on the device, fp32, on the plain policy.

A Qwen2 model with random weights (random biases and norm scales too, so a dropped term
shows) is built by transformers from a config (`--assets DIR`: that folder's config.json;
else `Shape.hf_config`), saved, and loaded by car_jax with the execution policy of
`common.check_policy` (on a CPU: `PLAIN` forced). Both sides run full fp32 matmuls (no
TF32: torch's flags off, jax at "highest").

- logits: a right-padded batch; max |difference| over the real tokens <= 1e-4 x max(1,
  the largest |logit|) (tests/test_model_parity.py's bound on a tiny model is 1e-4).
- greedy: left-padded prompts of different lengths, `generate_ids` (EOS off) against
  transformers' `generate` (greedy, min_new_tokens = max_new_tokens): every row's tokens
  equal. A row that differs reports its first differing position.

Needs torch and transformers; without torch the section says so and checks nothing.
"""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np

from .common import IdTokenizer, Options, Part, check, check_policy, max_abs, scale

PARITY_TOL = 1e-4  # x max(1, |logits| max)


@dataclasses.dataclass(frozen=True)
class Shape:
    hf_config: dict  # transformers Qwen2Config fields
    lengths: tuple[int, ...]  # the logits batch: one row per length, right-padded
    greedy_lengths: tuple[int, ...]  # the greedy prompts, left-padded
    greedy_new: int


TINY = Shape(dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False),
             lengths=(13, 9, 5), greedy_lengths=(7, 3, 5), greedy_new=8)
# Qwen2.5-0.5B's widths at 8 layers: real head sizes (64), GQA 7:1, biases, tied embeddings
FULL = Shape(dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=8,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, tie_word_embeddings=True),
             lengths=(96, 80, 64, 50), greedy_lengths=(40, 33, 27, 20, 17, 12, 9, 5), greedy_new=64)


def build_hf(opts: Options, shape: Shape):
    """(folder, torch model fp32 eval) of a random Qwen2 (or the assets' config)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if opts.assets is not None:
        cfg = transformers.AutoConfig.from_pretrained(opts.assets)
    else:
        cfg = transformers.Qwen2Config(**shape.hf_config, rms_norm_eps=1e-6)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = opts.work / "parity_model"
    model.save_pretrained(folder)
    if opts.assets is not None:  # its tokenizer files ride along (unused here)
        for f in opts.assets.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, folder / f.name)
    return folder, model


def logits_parity(model, hf, dev: str, lengths) -> dict:
    import jax
    import torch

    rng = np.random.default_rng(0)
    width = max(lengths)
    tokens = rng.integers(0, model.config.vocab_size, (len(lengths), width)).astype(np.int32)
    valid = np.arange(width)[None, :] < np.array(lengths)[:, None]
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long, device=dev),
                 attention_mask=torch.as_tensor(valid, dtype=torch.long, device=dev)).logits.float().cpu().numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model.forward(tokens, valid)[0])
    err, size = max_abs(ours[valid], ref[valid]), scale(ref[valid])
    return {"max_abs_diff": err, "logit_scale": size,
            "checks": {"logits": check(err <= PARITY_TOL * size, err, PARITY_TOL * size)}}


def greedy_parity(model, hf, dev: str, lengths, new: int) -> dict:
    import jax
    import torch

    from car_jax.rollout.generate import generate_ids, left_pad
    rng = np.random.default_rng(1)
    ids = [rng.integers(1, model.config.vocab_size, n).tolist() for n in lengths]
    with jax.default_matmul_precision("highest"):
        out = generate_ids(model, IdTokenizer(model.config.vocab_size), ids, max_new_tokens=new,
                           eos=np.array([], np.int32))
    tokens, valid = left_pad(ids, max(lengths), 0)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.as_tensor(tokens, dtype=torch.long, device=dev),
                          attention_mask=torch.as_tensor(valid, dtype=torch.long, device=dev),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    ref = ref[:, tokens.shape[1]:].cpu().numpy()
    ours = np.asarray(out.tokens)[:, :new]
    same = [bool((ref[i] == ours[i]).all()) for i in range(len(ids))]
    first = {i: int(np.argmax(ref[i] != ours[i])) for i in range(len(ids)) if not same[i]}
    return {"rows": len(ids), "rows_equal": sum(same), "new_tokens": new, "first_divergence": first,
            "checks": {"greedy": check(all(same), sum(same), len(ids))}}


def run(opts: Options, part: Part) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not importable: no reference to compare with", "checks": {}}
    import car_jax
    shape = TINY if opts.tiny else FULL
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    folder, hf = build_hf(opts, shape)
    hf = hf.to(dev)
    model = car_jax.load_model(folder, dtype="float32", progress=False, policy=check_policy())
    out = {"policy": model.module.policy.name, "torch_device": dev, "layers": model.config.n_layers,
           "d_model": model.config.d_model, "vocab": model.config.vocab_size}
    logits = logits_parity(model, hf, dev, shape.lengths)
    part("logits", logits)
    greedy = greedy_parity(model, hf, dev, shape.greedy_lengths, shape.greedy_new)
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()  # the next sections' JAX wants the memory
    return {**out, "logits": {k: v for k, v in logits.items() if k != "checks"},
            "greedy": {k: v for k, v in greedy.items() if k != "checks"},
            "checks": {**logits["checks"], **greedy["checks"]}}


def summary(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    lg, gr = r["logits"], r["greedy"]
    return (f"fp32 logits max |diff| {lg['max_abs_diff']:.1e} (logits up to {lg['logit_scale']:.1f}, limit "
            f"{PARITY_TOL:.0e} x that); greedy {gr['rows_equal']}/{gr['rows']} rows x {gr['new_tokens']} tokens equal "
            f"to transformers; policy {r['policy']}, torch on {r['torch_device']}")
