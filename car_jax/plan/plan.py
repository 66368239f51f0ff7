"""`make_plan`: whether a training config fits a mesh of a chip, per device, without weights.

    plan = make_plan(cfg, fsdp=4, tp=1, chip="v5p")       # cfg: a TrainConfig
    print(format_table(plan)); plan.to_json()

The byte counts are `plan.memory`'s (see its docstring for what each holds), the FLOPs
`train.flops`'s, the HBM the chip table's (`train.flops.CHIPS`). The peak is the larger
of the two phases, rollout and train; a config fits when it stays under FIT_FRACTION of
the chip's HBM (the rest is left to the runtime, compiled code and fragmentation).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from car_jax.models.config import ModelConfig
from car_jax.plan import memory as mem
from car_jax.plan.arch import model_config
from car_jax.plan.shapes import Shapes
from car_jax.train import flops
from car_jax.train.config import TrainConfig

FIT_FRACTION = 0.9
PROMPT_TOKENS = 512  # the longest prompt assumed by default: the search template and a question fit
DEFAULT_CHIP = "v5p"  # `car-jax plan`'s chip when neither --chip nor the config's file name names one


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    chip: str
    fsdp: int
    tp: int
    shapes: Shapes
    params_bytes: int  # the policy's weights (storage dtype; with LoRA the base plus the float32 adapters)
    grads_bytes: int  # the gradient sum and one micro-batch's gradients (param dtype; LoRA: the adapters')
    gathered_bytes: int  # fsdp > 1: one layer's and the head's weights gathered whole (param dtype)
    train_gathered_bytes: int  # what the train step holds of them: x2, with gradients (`memory.train_gathered_bytes`)
    opt_state_bytes: int  # AdamW's two moments (param dtype; LoRA: the adapters')
    ref_bytes: int  # the frozen reference (KL on), else 0; LoRA: 0 (the base, adapters off, is the reference)
    kv_cache_bytes: int  # the rollout's caches (decode and park rows)
    narrowing_bytes: int  # the tail's narrowed cache and its logits, beside the caches for a moment
    rollout_temp_bytes: int  # the rollout's widest prefill or decode loop
    activation_bytes: int  # the train step's, with the config's remat setting
    activation_remat_bytes: int
    activation_no_remat_bytes: int
    batch_bytes: int  # the step's rows on the device and the mini-batch the train step takes
    hbm_bytes: int
    flops_per_step: float  # model FLOPs of one step, per device

    @property
    def held_bytes(self) -> int:
        """What stays on the device across phases: weights, moments, reference."""
        return self.params_bytes + self.opt_state_bytes + self.ref_bytes

    @property
    def train_bytes(self) -> int:
        return (self.held_bytes + self.batch_bytes + self.grads_bytes + self.train_gathered_bytes
                + self.activation_bytes)

    @property
    def kv_peak_bytes(self) -> int:
        """The rollout's KV memory at its peak: its caches and, while the tail narrows, the
        narrowed copy."""
        return self.kv_cache_bytes + self.narrowing_bytes

    @property
    def rollout_bytes(self) -> int:
        """Weights, moments, reference and caches, plus the larger of a program's
        temporaries and gathered weights and the narrowed copy between programs."""
        return (self.held_bytes + self.kv_cache_bytes
                + max(self.gathered_bytes + self.rollout_temp_bytes, self.narrowing_bytes))

    @property
    def total_bytes(self) -> int:
        return max(self.train_bytes, self.rollout_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= FIT_FRACTION * self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        """The JSON object of `car-jax plan --json`: every byte figure per device."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "shapes"}
        out.update(total_bytes=self.total_bytes, fits=self.fits, train_bytes=self.train_bytes,
                   rollout_bytes=self.rollout_bytes, kv_peak_bytes=self.kv_peak_bytes,
                   shapes=dataclasses.asdict(self.shapes), fit_fraction=FIT_FRACTION)
        return out


def parse_mesh(text: str) -> tuple[int, int]:
    """"fsdp=4,tp=2" (either part may be left out: 1) -> (4, 2); a ValueError naming the bad part."""
    sizes = {"fsdp": 1, "tp": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: {part!r} is not fsdp=N or tp=N with N >= 1 (e.g. --mesh fsdp=4,tp=2)")
        sizes[key.strip()] = int(value)
    return sizes["fsdp"], sizes["tp"]


def config_mesh(cfg: TrainConfig, chips: int | None = None) -> tuple[int, int]:
    """The config's own (fsdp, tp): its mesh section, with -1 resolved over `chips` devices."""
    fsdp, tp = cfg.mesh.fsdp, cfg.mesh.tp
    if -1 not in (fsdp, tp):
        return fsdp, tp
    n = chips or cfg.mesh.devices
    if not n:
        raise ValueError(f"mesh.fsdp={fsdp}, mesh.tp={tp}: -1 takes the devices there are; give --mesh fsdp=F,tp=T "
                         f"(or mesh.devices) to plan for a number of chips")
    other = tp if fsdp == -1 else fsdp
    if n % other:
        raise ValueError(f"mesh: {n} devices do not split into groups of {other}; give --mesh fsdp=F,tp=T")
    return (n // other, tp) if fsdp == -1 else (fsdp, n // other)


def step_flops(model: ModelConfig, cfg: TrainConfig, prompt_tokens: int) -> float:
    """Model FLOPs of a step whose every episode uses its whole budget (`train.flops`):
    prompts_per_step distinct prompts of `prompt_tokens`, G responses each of the
    maximum response length, the rollout over every trajectory."""
    r, rl = cfg.rollout, cfg.rl
    u, b, p, n = rl.prompts_per_step, rl.prompts_per_step * r.group_size, prompt_tokens, r.max_response_length
    update = (u * p + b * n, b * n, u * p * p + b * n * (p + n))
    sampled = b * (r.max_turns + 1) * r.max_response_tokens
    rollout = (b * (p + n), sampled, b * (p + n) ** 2)
    passes = int(bool(rl.loss.kl_coef)) + int(bool(rl.recompute_old_logp))
    return flops.step_flops(model, update, rollout, rl.epochs, passes)


def make_plan(cfg: TrainConfig, fsdp: int, tp: int, chip: str, prompt_tokens: int = PROMPT_TOKENS,
              model: ModelConfig | None = None) -> Plan:
    """The per-device plan of `cfg` on an fsdp x tp mesh of `chip` (a `train.flops.CHIPS`
    name). `model`: the architecture (default: `arch.model_config(cfg.model.path)`).
    Raises ValueError / PlanError naming a bad chip, a mesh that does not split the model or
    the batch, FileNotFoundError for a model with no config.json."""
    hw = flops.chip_named(chip)
    model = model_config(cfg.model.path) if model is None else model
    shapes = Shapes.of(cfg, fsdp, tp, prompt_tokens)
    for name, rows in (("rl.micro_batch", shapes.micro_rows), ("rollout rows", shapes.rollout_rows)):
        if rows % fsdp:
            raise mem.PlanError(f"--mesh: {name} ({rows} rows) does not split over fsdp={fsdp}; use an fsdp that "
                                f"divides {rows}, or change {name}")
    pm = cfg.model
    model = dataclasses.replace(model, lora=pm.lora)  # the config's adapters (none for rank 0)
    tree = mem.param_shapes(model, pm)
    held = mem.bytes_per_device(tree, fsdp, tp)
    trained = mem.bytes_per_device(mem.adapter_shapes(tree), fsdp, tp) if pm.lora.rank else held
    cb = mem.dtype_bytes(pm.dtype)
    remat, plain = (mem.activation_bytes(model, shapes, cb, r) for r in (True, False))
    mini, step = mem.batch_bytes(shapes)
    return Plan(model=cfg.model.path or "SmolLM2-135M-Instruct", chip=hw.name, fsdp=fsdp, tp=tp, shapes=shapes,
                params_bytes=held, grads_bytes=2 * trained, opt_state_bytes=2 * trained,
                gathered_bytes=mem.gathered_bytes(tree, fsdp, tp),
                train_gathered_bytes=mem.train_gathered_bytes(tree, fsdp, tp, pm.lora.rank),
                ref_bytes=held if cfg.rl.loss.kl_coef and not pm.lora.rank else 0,
                kv_cache_bytes=mem.kv_cache_bytes(model, shapes, cb),
                narrowing_bytes=mem.narrowing_bytes(model, shapes, cb),
                rollout_temp_bytes=mem.rollout_temp_bytes(model, shapes, cb),
                activation_bytes=remat if pm.remat else plain, activation_remat_bytes=remat,
                activation_no_remat_bytes=plain, batch_bytes=mini + step, hbm_bytes=int(hw.hbm_bytes),
                flops_per_step=step_flops(model, cfg, prompt_tokens) / (fsdp * tp))


def max_rollout_rows(cfg: TrainConfig, plan: Plan, model: ModelConfig) -> int:
    """The most rollout rows (a multiple of fsdp) whose rollout phase stays under
    FIT_FRACTION of the HBM with everything else of `plan` held; 0 if none."""
    cb = mem.dtype_bytes(cfg.model.dtype)

    def fits(rows: int) -> bool:
        shapes = dataclasses.replace(plan.shapes, rollout_rows=rows)
        other = dataclasses.replace(plan, shapes=shapes, kv_cache_bytes=mem.kv_cache_bytes(model, shapes, cb),
                                    narrowing_bytes=mem.narrowing_bytes(model, shapes, cb),
                                    rollout_temp_bytes=mem.rollout_temp_bytes(model, shapes, cb))
        return other.rollout_bytes <= FIT_FRACTION * plan.hbm_bytes

    lo, hi = 0, plan.shapes.step_rows // plan.fsdp  # rows per device
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * plan.fsdp) else (lo, mid - 1)
    return lo * plan.fsdp
