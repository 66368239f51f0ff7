"""One GRPO step (rollout + update), car_jax against TRL's `GRPOTrainer`, on the embedded
SmolLM2-135M-Instruct (CPU), same prompts, batch, group size, lengths, KL coef and
reward, in one run on the same machine.

    .venv/bin/python benchmarks/bench_grpo_step.py [--prompts 8] [--group 4] [--new 128] [--steps 4]

Both sides sample exactly --new tokens per completion (EOS suppressed), temperature 1,
fp32 weights with --dtype compute (default float32; bfloat16 is torch autocast in TRL),
beta / kl_coef 0.001 (so both run a reference forward), 4 gradient-accumulation
micro-batches, one optimizer step per rollout. Needs `pip install trl==1.16.0` (the
`bench` extra).

The steps are paired: car_jax compiles first (its step 0), then TRL trains for --steps
steps and one car_jax step runs right after each TRL step, so both sides of a pair see
the same state of the machine (a shared machine drifts by 10-30% over minutes). TRL's
first step (warm-up) and its pair are left out; the ratio reported is the median over
the other pairs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/single_turn.py

from common import header  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
             "What is the boiling point of water at sea level?", "Name a prime number larger than 10.",
             "Which planet is known as the red planet?", "What language is spoken in Brazil?",
             "Who painted the Mona Lisa?"]


def toy_reward(texts: list[str]) -> list[float]:
    """Any cheap reward does: prefers completions that mention a digit."""
    return [float(any(c.isdigit() for c in t)) for t in texts]


def car_jax_stepper(folder, args):
    """Sets car_jax up; returns `step() -> (seconds, split)`, one GRPO step per call (the
    first compiles)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import car_jax
    from car_jax.rl import grpo
    from car_jax.loading import Model
    from car_jax.rollout.generate import generate_ids
    from car_jax.rollout.sampling import Sampler
    from car_jax.calibration.rewards import RewardConfig, RewardInputs, reward_fn
    from car_jax.rl.batches import chunked_logprobs, make_scorer, micro_batches, to_device
    from car_jax.rl.host_batch import micro_plan
    from car_jax.rl.steps import OptimConfig, init_state, make_logprob_fn, make_optimizer, make_train_step
    from tests.single_turn import single_turn_batch

    model = car_jax.load_model(folder, progress=False, dtype=args.dtype, param_dtype="float32")
    tok = car_jax.load_tokenizer(folder)
    ref = jax.tree.map(jnp.copy, model.params)
    opt = make_optimizer(OptimConfig(lr=1e-6, total_steps=100))
    state = init_state(model.params, opt)
    step_fn = make_train_step(model.module, opt, grpo.LossConfig(kl_coef=0.001), temperature=1.0)
    score = make_scorer(reward_fn(RewardConfig(kind="binary")))  # the reward is the toy reward itself
    logprob_fn = make_logprob_fn(model.module, 1.0)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS[: args.prompts]]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(args.group)]
    micro = len(ids) // 4
    box = {"state": state, "step": 0}

    def step() -> tuple[float, dict[str, float]]:
        state, split = box["state"], {}
        start = time.perf_counter()
        policy = Model(model.config, state.params, model.module)
        out = generate_ids(policy, tok, ids, max_new_tokens=args.new, sampler=Sampler(1.0), seed=box["step"],
                           eos=np.array([], np.int32))
        split["rollout"] = time.perf_counter() - start
        texts = [tok.decode(out.tokens[i]) for i in range(len(ids))]
        groups = np.repeat(np.arange(args.prompts), args.group)
        n = len(ids)
        inputs = RewardInputs(np.array(toy_reward(texts)) == 1.0, np.zeros(n, np.float32), np.ones(n, bool))
        host = single_turn_batch(ids, out, tok.pad_token_id, inputs, groups)
        batch, _ = score(to_device(host))
        plan = micro_plan(host.prompt_of, np.arange(n), micro)
        mark = time.perf_counter()
        batch = batch.replace(ref_logp=chunked_logprobs(logprob_fn, ref, batch, plan))
        jax.block_until_ready(batch.ref_logp)
        split["reference log-probs"] = time.perf_counter() - mark
        mark = time.perf_counter()
        state, metrics = step_fn(state, micro_batches(batch, plan))
        jax.block_until_ready(state.params)
        split["update (4 micro-batches)"] = time.perf_counter() - mark
        box["state"], box["step"] = state, box["step"] + 1
        return time.perf_counter() - start, split

    return step


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


def trl_steps(folder, args, n_steps: int, after_step, settings: dict) -> tuple[list[float], dict[str, float]]:
    """TRL's step times (and the last step's split); `after_step()` runs after each step,
    outside its timed span. The GRPOConfig settings that shape the step go into `settings`."""
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
            after_step()

    cfg = GRPOConfig(output_dir="/tmp/trl_bench", per_device_train_batch_size=args.prompts * args.group // 4,
                     gradient_accumulation_steps=4, num_generations=args.group,
                     max_completion_length=args.new, temperature=1.0, beta=0.001, learning_rate=1e-6,
                     max_steps=n_steps, use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", logging_steps=1,
                     generation_kwargs={"min_new_tokens": args.new}, dataloader_num_workers=0, seed=0,
                     bf16=args.dtype == "bfloat16", gradient_checkpointing=args.trl_gradient_checkpointing == "on")
    settings.update(gradient_checkpointing=cfg.gradient_checkpointing, beta=cfg.beta, bf16=cfg.bf16,
                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                    per_device_train_batch_size=cfg.per_device_train_batch_size, loss_type=cfg.loss_type)
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
    ap.add_argument("--steps", type=int, default=4, help="TRL steps; the first is warm-up and not compared")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype on both sides (weights stay fp32): car_jax model.dtype, TRL bf16=True")
    ap.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default="on",
                    help="TRL's GRPOConfig.gradient_checkpointing (on by default in TRL 1.16; car_jax does not "
                         "recompute layers here)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (TRL's first step is warm-up and is not compared)")
    from car_jax.checkpoints.embedded import default_model_dir
    folder = default_model_dir()
    car_jax_step = car_jax_stepper(folder, args)
    first, _ = car_jax_step()  # compiles
    ours: list[tuple[float, dict[str, float]]] = []
    settings: dict = {}
    theirs, their_split = trl_steps(folder, args, args.steps, lambda: ours.append(car_jax_step()), settings)
    import trl
    print(header(f"One GRPO step, SmolLM2-135M, {args.dtype} compute, {args.prompts} prompts x {args.group} "
                 f"generations x {args.new} new tokens", f"python benchmarks/bench_grpo_step.py --prompts {args.prompts} "
                 f"--group {args.group} --new {args.new} --steps {args.steps} --dtype {args.dtype} "
                 f"--trl-gradient-checkpointing {args.trl_gradient_checkpointing}"))
    print("TRL GRPOConfig: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n")
    print(f"car_jax's first step (with compiles): {first:.1f} s; TRL {trl.__version__}'s first step "
          f"(warm-up, not compared): {theirs[0]:.1f} s\n")
    print("| pair | TRL `GRPOTrainer` step (s) | car_jax step right after it (s) | car_jax / TRL |")
    print("|---:|---:|---:|---:|")
    ratios = []
    for i in range(1, len(theirs)):
        ratios.append(ours[i][0] / theirs[i])
        print(f"| {i} | {theirs[i]:.1f} | {ours[i][0]:.1f} | {ratios[-1]:.3f} |")
    print(f"\ncar_jax time / TRL time, median over {len(ratios)} pairs: **{statistics.median(ratios):.3f}** "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    print("car_jax's last step: " + ", ".join(f"{k} {v:.1f} s" for k, v in ours[-1][1].items()))
    if their_split:
        print("TRL's last step: " + ", ".join(f"{k} {v:.1f} s" for k, v in their_split.items()))


if __name__ == "__main__":
    main()
