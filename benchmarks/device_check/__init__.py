"""The device check's sections (benchmarks/gpu_check.py runs them), one module each, in the
order they run:

    parity      car_jax against transformers: fp32 logits and greedy tokens (plain policy)
    attention   flash (blockwise) and cuDNN attention against dense: values and gradients
    decode      decode loop tokens/s at three batch sizes, share of HBM bandwidth, compile
    train_step  GRPO train step time, MFU and compile, remat off and on
    engine      episode engine: bounded slots give the episodes of all at once
    recipe      a few steps of configs/experiment/world_car_gpu.yaml through the trainer

Each module has `TINY` and `FULL` shapes, `run(opts, part) -> dict` (its measurements and
`checks`: name -> {"ok", "value", "limit"}) and `summary(result) -> str`. Importing them
imports no jax (the runner's parent process never touches the accelerator).
"""
from . import attention, decode, engine, parity, recipe, train_step

SECTIONS = {"parity": parity, "attention": attention, "decode": decode, "train_step": train_step,
            "engine": engine, "recipe": recipe}
