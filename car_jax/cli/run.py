"""`car-jax run`: the main job, end to end, on the embedded default model
(SmolLM2-135M-Instruct, CPU) and the built-in offline world:

  1. convert the shipped GGUF to an HF folder (once, cached) and answer a chat prompt;
  2. evaluate the base model on a slice of the world's dev split (search agent);
  3. train CAR: an SFT warm start on world demonstrations (the 135M model does not know
     the tag format), then GRPO with the MSCR reward;
  4. evaluate the trained policy on the same slice and print both tables, with a closing
     note read off its own numbers (how many questions it states its most common confidence
     on, the AUROC of its stated and of its expected confidence);
  5. with `--control`, the positive control's quick version (`car-jax control --quick`):
     a tiny random model learns through the same trainer the confidence two coin kinds deserve
     (p = 0.1 and 0.9) with the Brier reward and does not with the binary one; its table and
     figure. It takes about 9 minutes on two cores, longer than steps 1-4 together, so it is
     not in the default run.

The sizes are small so that it finishes in minutes on two CPU cores; `car-jax train` and
`car-jax eval` with a config from configs/ run the real thing. Every config is built (and
checked) before the model loads.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_PROMPT = "In one sentence: why should an AI agent say how confident it is in its answers?"


def register(sub) -> None:
    p = sub.add_parser("run", help="the main job on the embedded default model (train + evaluate CAR)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat prompt of step 1 (default: a question about "
                   "stating confidence)")
    p.add_argument("--out", default="runs/default", help="run folder: training, both evaluations and the control "
                   "(default runs/default)")
    p.add_argument("--eval-questions", type=_at_least(1), default=8,
                   help="world dev questions each evaluation answers (steps 2 and 4; default 8)")
    p.add_argument("--sft-steps", type=_at_least(0), default=8,
                   help="SFT warm-start steps on world demonstrations before GRPO (default 8; 0: none)")
    p.add_argument("--rl-steps", type=_at_least(1), default=2, help="GRPO steps with the MSCR reward (default 2)")
    p.add_argument("--chat-only", action="store_true", help="stop after the chat answer")
    p.add_argument("--control", action="store_true", help="also run the positive control's quick version "
                   "(step 5, about 9 minutes on two cores)")
    p.add_argument("--control-steps", type=_at_least(1), default=None,
                   help="GRPO steps of each control arm (default: the quick control's, 60)")
    p.set_defaults(func=_run)


def _at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _eval_config(model_path: str, questions: int, out_dir: Path):
    """The search agent on the first `questions` world dev questions, as `car-jax eval`
    runs it (`car_jax.eval`); model_path "" is the embedded model."""
    from car_jax.config import load_config
    from car_jax.eval.config import EvalConfig

    model = [f"model.path={model_path}"] if model_path else []  # an empty override reads as null
    return load_config(EvalConfig, None, [
        *model, "data.path=world", "data.split=dev", f"data.limit={questions}", "mode=search",
        "episode.max_turns=1", "episode.max_response_tokens=64", "episode.max_obs_tokens=192",
        f"output.dir={out_dir}", "output.resume=true", "output.n_boot=200"])


def _train_config(args, out: Path):
    from car_jax.config import load_config
    from car_jax.train.config import TrainConfig

    return load_config(TrainConfig, None, [
        f"run.dir={out / 'train'}", f"rl.steps={args.rl_steps}", "rl.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_turns=1", "rollout.max_response_tokens=64", "rollout.max_obs_tokens=192",
        "rl.optim.lr=2e-6", "rl.micro_batch=4", "data.limit=64", "sft.data=world",
        f"sft.steps={args.sft_steps}", "sft.batch=2", "sft.lr=1e-4", "mesh.devices=1",
        "model.remat=true"])  # recompute layers in the backward pass: a few GB instead of ~15


def _evaluate(cfg, label: str) -> dict:
    from car_jax.eval.job import run_eval

    print(f"\n== evaluating {label} on {cfg.data.limit} world dev questions (search agent) ==")
    return run_eval(cfg, label=label, log=lambda _: None)


def _run(args) -> int:
    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir
    from car_jax.eval.runner import compare_table, format_table
    from car_jax.rollout.generate import generate
    from car_jax.train.trainer import train

    out = Path(args.out)
    cfg = _train_config(args, out)  # the configs first: a bad value fails before the model loads
    base_eval = _eval_config("", args.eval_questions, out / "eval_base")
    car_eval = _eval_config(str(out / "train" / "hf"), args.eval_questions, out / "eval_car")
    if args.control:  # the control's configs too (constants, but checked before anything loads)
        from car_jax.experiment import control
        control.arm_config(out / "control", control.ARMS["brier"], 0, args.control_steps or control.QUICK_STEPS,
                           [f"data.train_split={control.QUICK_SPLIT}"])
    folder = default_model_dir()
    model = car_jax.load_model(folder)
    tokenizer = car_jax.load_tokenizer(folder)
    start = time.perf_counter()
    [answer] = generate(model, tokenizer, [[{"role": "user", "content": args.prompt}]], max_new_tokens=64)
    print(f"user: {args.prompt}\nassistant: {answer}")
    print(f"({time.perf_counter() - start:.1f} s, greedy, {model.config.n_layers} layers, CPU)")
    if args.chat_only:
        return 0
    del model

    before = _evaluate(base_eval, "base SmolLM2-135M-Instruct")
    print(format_table(before))

    print(f"\n== training CAR (SFT warm start {args.sft_steps} steps, GRPO + MSCR {args.rl_steps} steps) ==")
    rows = train(cfg)
    for r in rows:
        print(f"step {r['step']}: reward {r['reward']:.3f} accuracy {r['accuracy']:.3f} ece {r['ece']:.3f} "
              f"format_ok {r['format_ok']:.2f} tool calls {r['tool_calls']:.2f}")

    after = _evaluate(car_eval, "car_jax CAR policy")
    print(format_table(after))
    print(f"\n== before / after CAR training ({before['n']} world dev questions, search agent) ==")
    print(compare_table({"base": before, "CAR": after}))
    print("\n" + closing_note(after, out / "eval_car", args.rl_steps, cfg.rl.prompts_per_step * cfg.rollout.group_size))
    if args.control:
        _control(out / "control", args.control_steps or control.QUICK_STEPS)
    print(f"\nrun folder:           {out}")
    print(f"training metrics:     {out / 'train' / 'metrics.jsonl'} (SFT: {out / 'train' / 'sft' / 'metrics.jsonl'})")
    print(f"TensorBoard logs:     {out / 'train' / 'tb'}   (tensorboard --logdir {out / 'train' / 'tb'})")
    print(f"reliability diagrams: {out / 'eval_base' / 'reliability.png'}, {out / 'eval_car' / 'reliability.png'}")
    print(f"trained policy:       {out / 'train' / 'hf'} (HF folder; checkpoints in {out / 'train' / 'checkpoints'})")
    if args.control:
        print(f"positive control:     {out / 'control' / 'CONTROL.md'}, {out / 'control' / 'control.png'}")
    else:
        print("positive control:     not run; `car-jax run --control` or `car-jax control --quick` runs its quick "
              "version (about 9 minutes on two cores)")
    return 0


def closing_note(summary: dict, eval_dir: Path, rl_steps: int, trajectories: int) -> str:
    """What the trained policy's own evaluation shows: the confidence it states most and on
    how many questions, and whether its stated and its expected confidence (at the tag, over
    every value 0..100) tell right answers from wrong ones (AUROC)."""
    import json
    from collections import Counter

    records = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    value, count = Counter(round(r["confidence"], 2) for r in records).most_common(1)[0]
    expected = summary.get("expected") or {}

    def auroc(x):
        return "undefined (one class)" if x is None or x != x else f"{x:.2f}"

    return (f"note: what this run shows. After {rl_steps} GRPO steps on {trajectories} trajectories the policy states "
            f"{value:.2f} on {count} of {len(records)} questions (accuracy {summary['accuracy']:.2f}); the AUROC of "
            f"its stated confidence is {auroc(summary['auroc'])} and of its expected confidence at the tag "
            f"{auroc(expected.get('auroc'))} (0.5: no better than chance at telling right answers from wrong; below "
            "0.5: more confident when wrong). A smoke test of the whole loop at this size, not a calibrated agent: "
            "the reward experiment (`car-jax experiment --config configs/experiment/world_car.yaml`, RESULTS.md) "
            "measures the rewards against each other, and the positive control (`car-jax control`) shows what the "
            "trainer can learn.")


def _control(out: Path, steps: int) -> None:
    """The positive control's quick version (its unit test's design), with its table."""
    from car_jax.experiment import control

    print(f"\n== positive control: coins with p = 0.1 and 0.9, Brier vs binary reward, {steps} GRPO steps each ==")
    rep = control.run_quick(out, steps=steps)
    print(control.format_report(rep))
    for name, arm in rep["arms"].items():
        error = arm["error"].get("0")
        print(f"{name}: mean |E[q | kind] - q*| = {error:.3f} ({'within' if error <= rep['tolerance'] else 'outside'} "
              f"{rep['tolerance']:g})")
