"""One GRPO step (rollout + update), car_jax against TRL's `GRPOTrainer`, on the embedded
SmolLM2-135M-Instruct (CPU), same prompts, batch, group size, lengths, KL coef and
reward, in one run on the same machine.

    .venv/bin/python benchmarks/bench_grpo_step.py [--prompts 8] [--group 4] [--new 128]

Both sides sample exactly --new tokens per completion (EOS suppressed), temperature 1,
fp32 weights with --dtype compute (default float32; bfloat16 is torch autocast in TRL),
beta / kl_coef 0.001 (so both run a reference forward), 4 gradient-accumulation
micro-batches, one optimizer step per rollout. Needs `pip install trl==1.16.0` (the
`bench` extra)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
             "What is the boiling point of water at sea level?", "Name a prime number larger than 10.",
             "Which planet is known as the red planet?", "What language is spoken in Brazil?",
             "Who painted the Mona Lisa?"]


def toy_reward(texts: list[str]) -> list[float]:
    """Any cheap reward does: prefers completions that mention a digit."""
    return [float(any(c.isdigit() for c in t)) for t in texts]


def car_jax_steps(folder, args, n_steps: int) -> tuple[list[float], dict[str, float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import car_jax
    from car_jax import grpo
    from car_jax.models.api import Model
    from car_jax.rollout.generate import generate_ids
    from car_jax.rollout.sampling import Sampler
    from car_jax.batches import chunked_logprobs, micro_batches, single_turn_arrays
    from car_jax.train_step import OptimConfig, init_state, make_logprob_fn, make_optimizer, make_train_step

    model = car_jax.load_model(folder, progress=False, dtype=args.dtype, param_dtype="float32")
    tok = car_jax.load_tokenizer(folder)
    ref = jax.tree.map(jnp.copy, model.params)
    opt = make_optimizer(OptimConfig(lr=1e-6, total_steps=100))
    state = init_state(model.params, opt)
    step_fn = make_train_step(model.module, opt, grpo.LossConfig(kl_coef=0.001, temperature=1.0))
    logprob_fn = make_logprob_fn(model.module, 1.0)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS[: args.prompts]]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(args.group)]
    micro = len(ids) // 4
    times, split = [], {}
    for step in range(n_steps):
        start = time.perf_counter()
        policy = Model(model.config, state.params, model.module)
        out = generate_ids(policy, tok, ids, max_new_tokens=args.new, sampler=Sampler(1.0), seed=step,
                           eos=np.array([], np.int32))
        split["rollout"] = time.perf_counter() - start
        texts = [tok.decode(out.tokens[i]) for i in range(len(ids))]
        groups = np.repeat(np.arange(args.prompts), args.group)
        arrays = single_turn_arrays(ids, out, np.array(toy_reward(texts)), groups, tok.pad_token_id)
        mark = time.perf_counter()
        arrays["ref_logp"] = chunked_logprobs(logprob_fn, ref, arrays, micro)
        split["reference log-probs"] = time.perf_counter() - mark
        mark = time.perf_counter()
        batch = micro_batches(arrays, np.arange(len(ids)), micro)
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(state.params)
        split["update (4 micro-batches)"] = time.perf_counter() - mark
        times.append(time.perf_counter() - start)
    return times, split


def _timed_method(obj, name: str, log: list[float]) -> None:
    """Wraps obj.name (if it exists) so each call appends its wall time to log."""
    inner = getattr(obj, name, None)
    if inner is None:
        return

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            log.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def trl_steps(folder, args, n_steps: int) -> tuple[list[float], dict[str, float]]:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[: args.prompts]] * 8)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stamps: list[float] = []

    class Stamp(transformers.TrainerCallback):
        def on_step_begin(self, a, s, c, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, a, s, c, **kw):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(output_dir="/tmp/trl_bench", per_device_train_batch_size=args.prompts * args.group // 4,
                     gradient_accumulation_steps=4, num_generations=args.group,
                     max_completion_length=args.new, temperature=1.0, beta=0.001, learning_rate=1e-6,
                     max_steps=n_steps, use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", logging_steps=1,
                     generation_kwargs={"min_new_tokens": args.new}, dataloader_num_workers=0, seed=0,
                     bf16=args.dtype == "bfloat16")
    trainer = GRPOTrainer(model=model, processing_class=tok, args=cfg, train_dataset=data,
                          reward_funcs=lambda completions, **kw: toy_reward(
                              [c[0]["content"] if isinstance(c, list) else c for c in completions]),
                          callbacks=[Stamp()])
    # where TRL's step goes (private methods of trl 1.16; the split is left out if they move)
    gen, scored = [], []
    _timed_method(trainer, "_generate", gen)
    _timed_method(trainer, "_generate_and_score_completions", scored)
    trainer.train()
    times = [stamps[i + 1] - stamps[i] for i in range(0, len(stamps) - 1, 2)]
    split = {}
    if len(gen) == len(scored) == n_steps:
        split = {"generation": gen[-1], "reference log-probs and rewards": scored[-1] - gen[-1],
                 "update (4 micro-batches)": times[-1] - scored[-1]}
    return times, split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype on both sides (weights stay fp32): car_jax model.dtype, TRL bf16=True")
    args = ap.parse_args()
    from car_jax.run_default import default_model_dir
    folder = default_model_dir()
    ours, split = car_jax_steps(folder, args, args.steps)
    theirs, their_split = trl_steps(folder, args, args.steps)
    import trl
    print(header(f"One GRPO step, SmolLM2-135M, {args.dtype} compute, {args.prompts} prompts x {args.group} "
                 f"generations x {args.new} new tokens", f"python benchmarks/bench_grpo_step.py --prompts {args.prompts} "
                 f"--group {args.group} --new {args.new} --steps {args.steps} --dtype {args.dtype}"))
    print("| system | first step (s) | last step (s) |")
    print("|---|---:|---:|")
    print(f"| TRL {trl.__version__} `GRPOTrainer` (transformers generate + torch) | {theirs[0]:.1f} | {theirs[-1]:.1f} |")
    print(f"| car_jax (jitted decode loop + jitted train step) | {ours[0]:.1f} (includes compile) | {ours[-1]:.1f} |")
    print(f"\ncar_jax time / TRL time (last step): **{ours[-1] / theirs[-1]:.3f}**")
    print("car_jax's last step: " + ", ".join(f"{k} {v:.1f} s" for k, v in split.items()))
    if their_split:
        print("TRL's last step: " + ", ".join(f"{k} {v:.1f} s" for k, v in their_split.items()))


if __name__ == "__main__":
    main()
