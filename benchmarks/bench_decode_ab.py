"""The decode loop against the one it replaced, in one process on one model: the old
`decode_segment` (loaded from a source file of an earlier commit) and `DecodeLoop.segment`
decode the same prefilled prompts in alternating order, so both see the same machine state.

    git show 6be8997:car_jax/rollout/decode.py > /tmp/decode_6be8997.py
    .venv/bin/python benchmarks/bench_decode_ab.py /tmp/decode_6be8997.py [--pairs 12] [--policies xla_cpu,plain]

Prints per policy: compile time of each, the decode times of each pair (16 chat prompts x
128 greedy tokens by default; a fresh cache copy per call; the first pair left out), the
after / before ratio per pair, its geometric mean with a 95% t interval, and whether the two
loops sampled the same tokens."""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_compile import QUESTIONS  # noqa: E402
from common import header  # noqa: E402

T975 = {5: 2.571, 11: 2.201, 17: 2.110, 23: 2.069}  # Student t quantiles by degrees of freedom


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "decode_segment"):
        raise SystemExit(f"{path} has no decode_segment: pass rollout/decode.py of a commit before the DecodeLoop")
    return module


def compare(old, folder, tok, ids, policy, new: int, pairs: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import car_jax
    from car_jax.rollout.decode import DecodeLoop
    from car_jax.rollout.generate import prefill_prompts
    from car_jax.rollout.sampling import Sampler

    model = car_jax.load_model(folder, progress=False, policy=policy)
    logits, cache, _ = prefill_prompts(model, ids, new, tok.pad_token_id or 0)
    live = jnp.ones(len(ids), bool)
    eos, tables = jnp.zeros((0,), jnp.int32), jnp.zeros((1, 1, model.config.vocab_size), jnp.int32)
    key = jax.random.key(0)
    start = time.perf_counter()
    before = old.decode_segment.lower(model.module, Sampler(), new, model.params, cache, logits, live, eos, tables,
                                      key, windows=()).compile()
    compile_before = time.perf_counter() - start
    loop = DecodeLoop(module=model.module, sampler=Sampler(), max_steps=new, windows=())
    start = time.perf_counter()
    after = DecodeLoop.segment.lower(loop, params=model.params, cache=cache, logits=logits, live=live, eos_ids=eos,
                                     tables=tables, key=key).compile()
    compile_after = time.perf_counter() - start
    calls = {"before": lambda c: before(model.params, c, logits, live, eos, tables, key)[0],
             "after": lambda c: after(params=model.params, cache=c, logits=logits, live=live, eos_ids=eos,
                                      tables=tables, key=key)[0]}
    times, tokens = {"before": [], "after": []}, {}
    for r in range(pairs + 1):  # pair 0 touches fresh memory: left out
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            fresh = jax.tree.map(jnp.copy, cache)  # the loops donate their cache
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            out = calls[name](fresh)
            jax.block_until_ready(out.tokens)
            if r:
                times[name].append(time.perf_counter() - start)
            tokens[name] = np.asarray(out.tokens)
    logs = [math.log(a / b) for a, b in zip(times["after"], times["before"])]
    half = T975.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.mean(logs)
    return {"policy": policy.name, "compile": (compile_before, compile_after), "times": times,
            "ratio": (math.exp(mean), math.exp(mean - half), math.exp(mean + half)),
            "same": bool((tokens["before"] == tokens["after"]).all())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", help="rollout/decode.py of the earlier commit (with decode_segment)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--policies", default="xla_cpu,plain")
    args = ap.parse_args()
    if args.pairs < 2:
        raise SystemExit(f"--pairs {args.pairs}: need >= 2 for an interval")

    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir
    from car_jax.models.policy import PLAIN, XLA_CPU

    old = load_old(args.old)
    policies = {"xla_cpu": XLA_CPU, "plain": PLAIN}
    folder = default_model_dir()
    tok = car_jax.load_tokenizer(folder)
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                     tokenize=False, add_generation_prompt=True) for i in range(args.batch)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    print(header(f"Decode loop after / before in one process, SmolLM2-135M fp32, batch {args.batch} x {args.new}",
                 f"python benchmarks/bench_decode_ab.py {args.old} --pairs {args.pairs}"))
    print("| policy | compile before / after (s) | decode after / before, geo. mean [95% t] | tokens equal |")
    print("|---|---|---|---|")
    for name in args.policies.split(","):
        if name not in policies:
            raise SystemExit(f"--policies: {name!r} is not one of {', '.join(policies)}")
        r = compare(old, folder, tok, ids, policies[name], args.new, args.pairs)
        m, lo, hi = r["ratio"]
        print(f"| {r['policy']} | {r['compile'][0]:.2f} / {r['compile'][1]:.2f} | {m:.3f} [{lo:.3f}, {hi:.3f}] | "
              f"{r['same']} |")
        for side in ("before", "after"):
            print(f"  {side}: " + ", ".join(f"{t:.2f}" for t in r["times"][side]))


if __name__ == "__main__":
    main()
