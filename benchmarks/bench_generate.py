"""Greedy generation throughput, car_jax vs transformers `generate`, on the embedded
SmolLM2-135M-Instruct (fp32, CPU), same prompts, same machine, same run.

    .venv/bin/python benchmarks/bench_generate.py [--batch 16] [--new 128]

Two cases, greedy, both sides in the same run:
- fixed: one-question chat prompts, exactly --new tokens per row (EOS disabled): the decode
  loop's raw speed.
- users' prompts: what `generate()` is called with: chat prompts of mixed lengths (some with
  a system prompt, some multi-turn, questions short and long), EOS on, up to --new tokens; a
  row stops at its EOS on both sides, so the wall time includes the rows that finish early
  waiting for the longest one (transformers, too, keeps finished rows in the batch, padded,
  until every row is done).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, timed  # noqa: E402

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
LONG = ("I am planning a week-long trip through the north of Italy in late autumn, travelling by train "
        "between the larger cities and staying two nights in each. Which three cities would you pick, and why?")


def users_prompts(n: int) -> list[list[dict]]:
    """n chat conversations of mixed shape and length (cycled)."""
    shapes = []
    for i, q in enumerate(QUESTIONS):
        shapes.append([{"role": "user", "content": q}])
        shapes.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        if i % 2 == 0:
            shapes.append([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
                           {"role": "user", "content": q + " Explain briefly."}])
    shapes.insert(3, [{"role": "user", "content": LONG}])
    return [shapes[i % len(shapes)] for i in range(n)]


QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
             "What is the boiling point of water at sea level?", "Name a prime number larger than 10.",
             "Which planet is known as the red planet?", "What language is spoken in Brazil?",
             "Who painted the Mona Lisa?"]


def compare(model, hf, tok, convs, new: int, eos_on: bool):
    """(car_jax steady-state s, first-call s, transformers s, generated tokens, rows equal to
    transformers' up to the first EOS) for greedy generation of `convs`."""
    import numpy as np
    import torch

    from car_jax.rollout.generate import eos_ids, generate_ids

    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = np.asarray(eos_ids(model, tok))
    run = lambda: generate_ids(model, tok, ids, max_new_tokens=new, eos=eos if eos_on else np.array([], np.int32))  # noqa: E731
    first, _ = timed(run)
    ours, out = timed(run, repeats=2)
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    kw = dict(eos_token_id=eos.tolist()) if eos_on else dict(min_new_tokens=new)

    def hf_run():
        with torch.no_grad():
            return hf.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id, **kw)

    theirs, ref = timed(hf_run, repeats=2)
    ref = ref[:, batch["input_ids"].shape[1]:].numpy()
    # without EOS, transformers' min_new_tokens bans EOS: compare each row up to our first EOS
    eos_set = set(eos.tolist())
    same = []
    for b in range(len(ids)):
        n = next((i for i, t in enumerate(out.tokens[b]) if t in eos_set), new)
        same.append(bool((ref[b, :n] == out.tokens[b, :n]).all()))
    return ours, first, theirs, int(out.length.sum()), float(np.mean(same)), [len(i) for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    import torch
    import transformers

    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir

    folder = default_model_dir()
    tok = car_jax.load_tokenizer(folder)
    model = car_jax.load_model(folder, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fixed = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.batch)]
    cases = [("fixed: one-question prompts, exactly --new tokens (EOS off)", compare(model, hf, tok, fixed, args.new, False)),
             ("users' prompts: mixed chat prompts, EOS on", compare(model, hf, tok, users_prompts(args.batch), args.new, True))]

    print(header(f"Greedy generation, SmolLM2-135M fp32, batch {args.batch}, up to {args.new} new tokens",
                 f"python benchmarks/bench_generate.py --batch {args.batch} --new {args.new}"))
    print(f"transformers {transformers.__version__} `generate` (torch {torch.__version__}) against car_jax "
          "(jitted prefill + `while_loop` decode); tokens/s counts the tokens each side generated\n")
    print("| case | prompt tokens | generated tokens | transformers (s) | car_jax steady (s) | car_jax first call (s) "
          "| speed-up | rows equal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, (ours, first, theirs, n, agree, lens) in cases:
        print(f"| {name} | {min(lens)}-{max(lens)} | {n} | {theirs:.2f} | {ours:.2f} | {first:.2f} | "
              f"**{theirs / ours:.2f}x** | {agree:.0%} |")


if __name__ == "__main__":
    main()
