"""Greedy generation throughput, car_jax vs transformers `generate`, on the embedded
SmolLM2-135M-Instruct (fp32, CPU), same prompts, same machine, same run.

    .venv/bin/python benchmarks/bench_generate.py [--batch 16] [--new 128]

Both sides generate exactly --new tokens per row (EOS disabled), greedy."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402

from common import header, timed  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
             "What is the boiling point of water at sea level?", "Name a prime number larger than 10.",
             "Which planet is known as the red planet?", "What language is spoken in Brazil?",
             "Who painted the Mona Lisa?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    import torch
    import transformers

    import car_jax
    from car_jax.rollout.generate import eos_ids, generate_ids
    from car_jax.checkpoints.embedded import default_model_dir

    folder = default_model_dir()
    tok = car_jax.load_tokenizer(folder)
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                     tokenize=False, add_generation_prompt=True) for i in range(args.batch)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    n_tokens = args.batch * args.new

    model = car_jax.load_model(folder, progress=False)
    no_eos = np.array([], np.int32)
    run = lambda: generate_ids(model, tok, ids, max_new_tokens=args.new, eos=no_eos)  # noqa: E731
    first, _ = timed(run)
    ours, out = timed(run, repeats=2)

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)

    def hf_run():
        with torch.no_grad():
            return hf.generate(**batch, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                               pad_token_id=tok.pad_token_id)
    theirs, ref = timed(hf_run, repeats=2)
    ref = ref[:, batch["input_ids"].shape[1]:].numpy()
    # transformers' min_new_tokens bans EOS, so compare each row up to our first EOS
    eos = set(np.asarray(eos_ids(model, tok)).tolist())
    same = []
    for b in range(args.batch):
        n = next((i for i, t in enumerate(out.tokens[b]) if t in eos), args.new)
        same.append(bool((ref[b, :n] == out.tokens[b, :n]).all()))
    agree = float(np.mean(same))

    print(header(f"Greedy generation, SmolLM2-135M fp32, batch {args.batch} x {args.new} new tokens",
                 f"python benchmarks/bench_generate.py --batch {args.batch} --new {args.new}"))
    print("| system | seconds | tokens/s |")
    print("|---|---:|---:|")
    print(f"| transformers {transformers.__version__} `generate` (torch {torch.__version__}) | {theirs:.2f} | "
          f"{n_tokens / theirs:.0f} |")
    print(f"| car_jax (jitted prefill + `while_loop` decode), steady state | {ours:.2f} | {n_tokens / ours:.0f} |")
    print(f"| car_jax first call (includes XLA compile) | {first:.2f} | {n_tokens / first:.0f} |")
    print(f"\nspeed-up (steady state): **{theirs / ours:.2f}x**; rows whose tokens equal transformers' up to "
          f"the first EOS: {agree:.0%}")


if __name__ == "__main__":
    main()
