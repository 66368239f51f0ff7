"""Correctness and speed of car_jax on one accelerator (made for a GPU), in one run.

    python benchmarks/gpu_check.py --assets DIR [--out DIR] [--sections parity,greedy,generate,grpo]

DIR holds a Hugging Face model folder's config.json and tokenizer files, no weights: the
script builds a model of that shape with random weights in transformers (seeded), saves
it, and both sides load that folder. Sections, each printed as it ends:

- parity: fp32 logits, car_jax against transformers, both on the accelerator with full
  fp32 matmuls (no TF32), on a right-padded batch; max |difference| over real tokens.
  car_jax runs the execution policy `load_model` picks for the backend (on a GPU: the
  plain one, layers scanned in every mode with one stacked KV cache).
- greedy: fp32 greedy continuations (EOS off) of 8 prompts; rows equal to transformers'.
- generate: bf16 sampling throughput, car_jax `generate_ids` against transformers
  `generate`, --batch rows x --new tokens (EOS off).
- grpo: one bf16 GRPO step of car_jax against TRL's `GRPOTrainer`, as in
  bench_grpo_step.py (needs trl importable).

Everything measured goes to OUT/gpu_check.json; a markdown summary is printed last."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the device
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from bench_grpo_step import QUESTIONS  # noqa: E402


def build_random_model(assets: Path, folder: Path, seed: int = 0):
    """A transformers model of the assets' config with random weights, saved to folder
    with the tokenizer files; returns the torch model (fp32, eval)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.from_pretrained(assets)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    for f in assets.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, folder / f.name)
    return model


def prompt_ids(tok, n: int) -> list[list[int]]:
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                     tokenize=False, add_generation_prompt=True) for i in range(n)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def parity(folder: Path, hf, dev) -> dict:
    import jax
    import torch

    import car_jax
    rng = np.random.default_rng(0)
    lengths = [96, 80, 64, 50]
    tokens = rng.integers(0, hf.config.vocab_size, (len(lengths), max(lengths))).astype(np.int32)
    valid = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long, device=dev),
                 attention_mask=torch.as_tensor(valid, dtype=torch.long, device=dev)).logits.float().cpu().numpy()
    model = car_jax.load_model(folder, dtype="float32", progress=False)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model.forward(tokens, valid)[0])
    diff = np.abs(ours - ref)[valid]
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "logit_scale": float(np.abs(ref[valid]).max()), "backend": jax.default_backend(),
            "policy": model.module.policy.name}


def greedy(folder: Path, hf, tok, dev, new: int = 64) -> dict:
    import jax
    import torch

    import car_jax
    from car_jax.rollout.generate import generate_ids
    ids = prompt_ids(tok, 8)
    model = car_jax.load_model(folder, dtype="float32", progress=False)
    with jax.default_matmul_precision("highest"):
        out = generate_ids(model, tok, ids, max_new_tokens=new, eos=np.array([], np.int32))
    width = max(len(p) for p in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = np.full((len(ids), width), pad)
    mask = np.zeros((len(ids), width), np.int64)
    for i, p in enumerate(ids):  # left padding, as generate wants
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.as_tensor(batch, device=dev), attention_mask=torch.as_tensor(mask, device=dev),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    ref = ref[:, width:].cpu().numpy()
    same = [bool((ref[i] == out.tokens[i, :new]).all()) for i in range(len(ids))]
    first = [int(np.argmax(ref[i] != out.tokens[i, :new])) for i in range(len(ids)) if not same[i]]
    return {"rows_equal": int(sum(same)), "rows": len(ids), "first_divergence": first}


def generate_speed(folder: Path, tok, dev, batch: int, new: int) -> dict:
    import torch
    import transformers

    import car_jax
    from car_jax.rollout.generate import generate_ids
    from car_jax.rollout.sampling import Sampler
    ids = prompt_ids(tok, batch)
    model = car_jax.load_model(folder, dtype="bfloat16", param_dtype="bfloat16", progress=False)
    no_eos = np.array([], np.int32)
    run = lambda seed: generate_ids(model, tok, ids, max_new_tokens=new, sampler=Sampler(1.0),  # noqa: E731
                                    seed=seed, eos=no_eos)
    start = time.perf_counter()
    run(0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    run(1)
    ours = time.perf_counter() - start
    del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(dev).eval()
    enc = tok([tok.decode(p) for p in ids], add_special_tokens=False, return_tensors="pt", padding=True,
              padding_side="left").to(dev)

    def hf_run():
        with torch.no_grad():
            hf.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0,
                        pad_token_id=tok.pad_token_id)
        torch.cuda.synchronize() if dev == "cuda" else None
    hf_run()
    start = time.perf_counter()
    hf_run()
    theirs = time.perf_counter() - start
    n = batch * new
    return {"batch": batch, "new": new, "car_jax_s": ours, "car_jax_first_s": first, "transformers_s": theirs,
            "car_jax_tok_s": n / ours, "transformers_tok_s": n / theirs, "speedup": theirs / ours}


def grpo_step(folder: Path, prompts: int, group: int, new: int) -> dict:
    import bench_grpo_step as b
    args = argparse.Namespace(prompts=prompts, group=group, new=new, dtype="bfloat16")
    ours, split = b.car_jax_steps(folder, args, 2)
    out = {"prompts": prompts, "group": group, "new": new, "car_jax_s": ours, "car_jax_split": split}
    try:
        theirs = b.trl_steps(folder, args, 2)
        out.update(trl_s=theirs, ratio=ours[-1] / theirs[-1])
    except Exception as e:  # noqa: BLE001 - trl missing or broken on this machine
        out["trl_error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--sections", default="parity,greedy,generate,grpo")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()

    import jax
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "torch": torch.__version__,
                     "torch_device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    print(json.dumps(results), flush=True)
    folder = Path(tempfile.mkdtemp()) / "model"
    hf = build_random_model(args.assets, folder).to(dev)
    import car_jax
    tok = car_jax.load_tokenizer(folder)
    sections = {
        "parity": lambda: parity(folder, hf, dev),
        "greedy": lambda: greedy(folder, hf, tok, dev),
        "generate": lambda: generate_speed(folder, tok, dev, args.batch, args.new),
        "grpo": lambda: grpo_step(folder, args.prompts, args.group, args.new),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as e:  # noqa: BLE001 - report and go on to the next section
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["section_s"] = time.perf_counter() - start
        print(name, json.dumps(results[name]), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(summary(results))


def summary(r: dict) -> str:
    lines = [f"GPU check: {r['torch_device']}, jax {r['jax']}, torch {r['torch']}", ""]
    if "max_abs_diff" in r.get("parity", {}):
        p = r["parity"]
        lines.append(f"- fp32 logits vs transformers: max |diff| {p['max_abs_diff']:.2e} (logits up to "
                     f"{p['logit_scale']:.1f}), backend {p['backend']}, policy {p.get('policy')}")
    if "rows_equal" in r.get("greedy", {}):
        g = r["greedy"]
        lines.append(f"- greedy fp32, 64 tokens: {g['rows_equal']}/{g['rows']} rows equal to transformers")
    if "speedup" in r.get("generate", {}):
        g = r["generate"]
        lines.append(f"- sampling bf16 {g['batch']} x {g['new']}: car_jax {g['car_jax_s']:.2f} s "
                     f"({g['car_jax_tok_s']:.0f} tok/s; first call {g['car_jax_first_s']:.1f} s), transformers "
                     f"{g['transformers_s']:.2f} s ({g['transformers_tok_s']:.0f} tok/s): {g['speedup']:.2f}x")
    if "car_jax_s" in r.get("grpo", {}):
        g = r["grpo"]
        split = ", ".join(f"{k} {v:.2f} s" for k, v in g["car_jax_split"].items())
        line = f"- GRPO step bf16 {g['prompts']} x {g['group']} x {g['new']}: car_jax {g['car_jax_s'][-1]:.2f} s ({split})"
        line += (f", TRL {g['trl_s'][-1]:.2f} s: ratio {g['ratio']:.2f}" if "ratio" in g else f"; TRL: {g.get('trl_error')}")
        lines.append(line)
    for k in ("parity", "greedy", "generate", "grpo"):
        if "error" in r.get(k, {}):
            lines.append(f"- {k}: {r[k]['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
