"""Section recipe: a few GRPO steps of the science experiment's accelerator recipe through
the real trainer, so that its time per step is measured rather than estimated.

The recipe is configs/experiment/world_car_gpu.yaml (the paired reward experiment at an
accelerator's budget: SmolLM2-135M-Instruct, bf16 compute over fp32 params, 32 prompts x
16 episodes a step, all 512 in flight, 16 micro-batches of 32 rows, world-large search
with BM25). Its training unit for arm `car`, seed 0, as `experiment.runner.plan` builds it,
runs `STEPS` steps with `train.Trainer` from the base model (the warm start's folder does
not exist here; its SFT does not change a step's cost) in a scratch folder, no HF export.
At tiny shapes the same unit runs with TINY_OVERRIDES: a random 2-layer Llama over the
byte tokenizer (`common.byte_tokenizer`) for the model, 2 prompts x 2 episodes, short turns,
fp32 compute (XLA:CPU compiles its bf16 layer loop far slower; nothing here is timed).
The trainer runs the execution policy `load_model` picks (on a CPU: XLA_CPU).

Reported per step: time/step and its split (rollout, logprobs, update), tokens/s, MFU;
the steady step time (median of the steps after the first, which compiles) and what it
makes of one run of the shipped recipe's rl.steps: the first step + (rl.steps - 1) x steady
(at tiny shapes that number describes nothing). Checks: every
step ran, with a finite loss and step time.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from .common import Options, Part, byte_tokenizer, check, random_model, save_folder

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "experiment" / "world_car_gpu.yaml"
ARM, SEED = "car", 0
FULL_STEPS, TINY_STEPS = 3, 2
TINY_MODEL = dict(model_type="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                  tie_embeddings=True)
TINY_OVERRIDES = ("train.rollout.group_size=2", "train.rl.prompts_per_step=2", "train.rollout.max_concurrent=4",
                  "train.rl.mini_batch=4", "train.rl.micro_batch=2", "train.rollout.max_response_tokens=8",
                  "train.rollout.max_obs_tokens=16", "train.model.dtype=float32")
KEYS = ("time/step", "time/rollout", "time/logprobs", "time/update", "tokens_per_s", "perf/mfu",
        "perf/model_tflops_per_device", "loss", "reward", "response_tokens")


def train_config(opts: Options, steps: int):
    """The TrainConfig of the experiment's unit train/car-s0 as run here."""
    from car_jax.experiment.config import load_experiment
    from car_jax.experiment.runner import plan

    overrides = [f"train.rl.steps={steps}"]
    if opts.tiny:
        from car_jax.models.config import ModelConfig
        tok = byte_tokenizer()
        model = random_model(ModelConfig(vocab_size=len(tok), **TINY_MODEL), dtype="float32", param_dtype="float32")
        folder = save_folder(model, tok, opts.work / "recipe_model")
        overrides += [*TINY_OVERRIDES, f"train.model.path={folder}"]
    cfg = load_experiment(CONFIG, overrides)
    unit = next(u for u in plan(cfg) if u.name == f"train/{ARM}-s{SEED}")
    t = unit.config
    run = dataclasses.replace(t.run, dir=str(opts.work / "recipe_run"), export_hf=False)
    return dataclasses.replace(t, model=cfg.train.model, run=run)


def recipe_steps() -> int:
    """rl.steps of one training run of the recipe as shipped."""
    from car_jax.experiment.config import load_experiment
    return load_experiment(CONFIG).train.rl.steps


def reporting_trainer(cfg, part: Part):
    """A `train.Trainer` that reports each step's KEYS as the step ends (so a run cut by its
    time box still tells its steps)."""
    from car_jax.train.trainer import Trainer

    class Reporting(Trainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.rows: list[dict] = []

        def step(self, step, timer):
            row = super().step(step, timer)
            picked = {"step": step, **{k: float(row[k]) for k in KEYS if k in row}}
            self.rows.append(picked)
            part(f"step_{step}", picked)
            return row

    return Reporting(cfg)


def run(opts: Options, part: Part) -> dict:
    steps = TINY_STEPS if opts.tiny else FULL_STEPS
    tc = train_config(opts, steps)
    trainer = reporting_trainer(tc, part)
    trainer.run()
    rows = trainer.rows
    times = [r["time/step"] for r in rows]
    steady = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    full_run = recipe_steps()
    out = {"config": str(CONFIG.relative_to(CONFIG.parents[2])), "unit": f"train/{ARM}-s{SEED}",
           "model": tc.model.path or "embedded SmolLM2-135M-Instruct", "policy": trainer.setup.model.module.policy.name,
           "rows_a_step": tc.rl.prompts_per_step * tc.rollout.group_size, "steps": rows,
           "first_step_s": times[0] if times else float("nan"), "steady_step_s": steady,
           "recipe_steps": full_run,
           "recipe_run_estimate_s": (times[0] + (full_run - 1) * steady) if len(times) > 1 else float("nan")}
    out["checks"] = {
        "steps_ran": check(len(rows) == steps, len(rows), steps),
        "finite": check(all(math.isfinite(r.get("loss", float("nan"))) and math.isfinite(r["time/step"])
                            for r in rows), [r.get("loss") for r in rows]),
    }
    return out


def summary(r: dict) -> str:
    steps = r["steps"]
    last = steps[-1] if steps else {}
    split = ", ".join(f"{k[5:]} {last[k]:.2f} s" for k in ("time/rollout", "time/logprobs", "time/update") if k in last)
    mfu = last.get("perf/mfu", float("nan"))
    return (f"{len(steps)} steps of {r['rows_a_step']} episodes ({r['policy']} policy): "
            f"first {r['first_step_s']:.1f} s, "
            f"then {r['steady_step_s']:.2f} s a step ({split}; MFU {'n/a' if mfu != mfu else f'{mfu:.1%}'}); "
            f"a {r['recipe_steps']}-step run of the recipe ~ {r['recipe_run_estimate_s'] / 60:.1f} min")
