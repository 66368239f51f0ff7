"""The decode loop under each execution policy, on the embedded SmolLM2-135M-Instruct
(fp32, CPU): how long the decode loop (`DecodeLoop.segment`) takes to lower and compile with the plain
policy's scanned layers (one stacked cache carried through a `lax.scan`) and with the
XLA:CPU policy's unrolled layers (a Python loop over per-layer weights and caches), and
its steady-state greedy tokens/s.

    .venv/bin/python benchmarks/bench_decode_compile.py [--batch 16] [--new 128] [--repeats 2]

Both loops run in one stage over the whole cache (`windows=()`), EOS disabled, from the
same prefilled prompts. Compile times are `jax.jit(...).lower(...).compile()` wall
times in a fresh process state for each policy (the persistent compilation cache is
not enabled here); tokens/s is the best of `--repeats` calls of the compiled loop."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402

from common import header  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
             "Name a prime number larger than 10.", "Which planet is known as the red planet?"]


def measure(folder, tok, ids, policy, new: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    import car_jax
    from car_jax.rollout.decode import DecodeLoop
    from car_jax.rollout.generate import prefill_prompts
    from car_jax.rollout.sampling import Sampler

    model = car_jax.load_model(folder, progress=False, policy=policy)
    logits, cache, _ = prefill_prompts(model, ids, new, tok.pad_token_id or 0)
    b = len(ids)
    args = dict(params=model.params, cache=cache, logits=logits, live=jnp.ones(b, bool),
                eos_ids=jnp.zeros((0,), jnp.int32), tables=jnp.zeros((1, 1, model.config.vocab_size), jnp.int32),
                key=jax.random.key(0))
    loop = DecodeLoop(module=model.module, sampler=Sampler(), max_steps=new, windows=())
    start = time.perf_counter()
    lowered = DecodeLoop.segment.lower(loop, **args)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats + 1):  # the first call touches fresh memory: left out
        fresh = jax.tree.map(jnp.copy, cache)  # the loop donates its cache
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        out, _ = compiled(**{**args, "cache": fresh})
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - start) if _ else best
    return {"policy": policy.name, "lower_s": lower_s, "compile_s": compile_s, "decode_s": best,
            "tok_s": b * new / best, "tokens": np.asarray(out.tokens)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import jax

    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir
    from car_jax.models.policy import PLAIN, XLA_CPU

    folder = default_model_dir()
    tok = car_jax.load_tokenizer(folder)
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                     tokenize=False, add_generation_prompt=True) for i in range(args.batch)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = [measure(folder, tok, ids, p, args.new, args.repeats) for p in (PLAIN, XLA_CPU)]
    same = bool((rows[0]["tokens"] == rows[1]["tokens"]).all())
    layers = {"plain": "scanned (`lax.scan`, stacked cache)", "xla_cpu": "unrolled (per-layer weights and cache)"}

    print(header(f"Decode loop compile and speed per policy, SmolLM2-135M fp32, batch {args.batch} x {args.new} "
                 f"new tokens, {jax.default_backend()}",
                 f"python benchmarks/bench_decode_compile.py --batch {args.batch} --new {args.new}"))
    print("| policy | layers | lower (s) | compile (s) | decode (s) | tokens/s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {layers[r['policy']]} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
              f"{r['decode_s']:.2f} | {r['tok_s']:.0f} |")
    print(f"\ngreedy tokens identical under both policies: {same}")


if __name__ == "__main__":
    main()
