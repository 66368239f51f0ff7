"""XLA's own accounting of a training run's memory: the real jitted programs lowered from
abstract inputs and compiled, without weights.

`xla_memory(cfg, model_cfg, mesh, shapes)` builds what the trainer builds (the Decoder with
the accelerator policy `PLAIN`, the optimizer, `steps.make_train_step` with the train
state's shardings, the rollout's `prefill.prefill` and the engine's decode call
`decode.DecodeLoop.run`) over
`jax.ShapeDtypeStruct`s that carry their `NamedSharding` (the param tree from
`jax.eval_shape` of the module's init, laid out by `sharding.params_shardings`), lowers
and compiles each program for `mesh` and reads `compiled.memory_analysis()`. On a CPU host
a fake mesh of N devices is `XLA_FLAGS=--xla_force_host_platform_device_count=N`. The
figures are per device: an SPMD program is compiled once for one device's shards.

The AdamW moments are laid out as the params are (the sharding table's train layout), as
`steps.init_state` lays them out (`steps.opt_state_shardings`). With `model.lora.rank` > 0
the state holds the adapters and the step takes the frozen base as its third argument
(`steps.make_train_step`), as the trainer runs it; the rollout reads base + adapters.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax import sharding as shd
from car_jax.models import lora
from car_jax.models.config import ModelConfig, as_dtype
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN
from car_jax.plan.shapes import Shapes
from car_jax.rl.steps import BATCH_KEYS, TrainState, make_optimizer, make_train_step, opt_state_shardings
from car_jax.rollout.decode import DecodeLoop, DecodeState
from car_jax.rollout.prefill import prefill
from car_jax.train.config import TrainConfig

# LLVM at -O0: the same buffer assignment (memory_analysis) as the default, compiled in
# about two thirds of the time (measured on the tiny configs of tests/test_plan.py)
OPTIONS = {"xla_backend_optimization_level": 0}
STOP_AUTOMATA = (2, 16)  # (A, Z) of the stop tables the decode loop takes: a few patterns of a few states


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled program's `memory_analysis()`, bytes per device."""
    argument: int
    output: int
    alias: int  # outputs that reuse a donated argument's buffer
    temp: int

    @property
    def peak(self) -> int:
        """What the program holds at once: its arguments, its outputs that do not reuse a
        donated argument, and its temporaries."""
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled) -> "Compiled":
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes))


def fake_mesh(fsdp: int, tp: int) -> Mesh:
    """The (fsdp, tp) mesh over the first fsdp x tp devices; a clear error when there are fewer."""
    n, have = fsdp * tp, len(jax.devices())
    if have < n:
        raise ValueError(f"mesh fsdp={fsdp} x tp={tp} needs {n} devices, jax sees {have}; on a CPU host run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return shd.make_mesh(fsdp, tp, jax.devices()[:n])


def _sds(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_params(module: Decoder, mesh: Mesh):
    """The param tree as ShapeDtypeStructs in the train layout (no weights are made)."""
    params = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    return _sds(params, shd.params_shardings(params, mesh))


def abstract_state(params, optimizer, mesh: Mesh) -> TrainState:
    """TrainState of ShapeDtypeStructs laid out as `steps.init_state` lays out a real one:
    the moments as their params (`steps.opt_state_shardings`), counters and step replicated."""
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    opt = _sds(jax.eval_shape(optimizer.init, params), opt_state_shardings(optimizer, params, params_sh, mesh))
    return TrainState(params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))


def _batch(mesh: Mesh, m: int, b: int, p: int, r: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The train step's batch (`steps.BATCH_KEYS`) [M, b, ...], rows over fsdp."""
    kinds = {"prompt": ((m, b, p), jnp.int32), "prompt_valid": ((m, b, p), bool), "prompt_index": ((m, b), jnp.int32),
             "tokens": ((m, b, r), jnp.int32), "valid": ((m, b, r), bool), "advantages": ((m, b), jnp.float32)}
    rows2, rows3 = NamedSharding(mesh, P(None, "fsdp")), NamedSharding(mesh, P(None, "fsdp", None))
    out = {}
    for key in BATCH_KEYS:
        shape, dtype = kinds.get(key, ((m, b, r), jnp.float32))
        out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=rows2 if len(shape) == 2 else rows3)
    return out


def _cache(module: Decoder, mesh: Mesh, rows: int, capacity: int):
    """The rollout's KV cache (the sampling table's layout) as ShapeDtypeStructs."""
    return jax.eval_shape(lambda: module.policy.init_cache(module.cfg, rows, capacity, module.dtype, mesh))


PROGRAMS = ("train_step", "prefill", "decode")


def xla_memory(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, shapes: Shapes,
               programs: tuple[str, ...] = PROGRAMS) -> dict[str, Compiled]:
    """{"train_step", "prefill", "decode"} (those of `programs`): the compiled programs'
    memory per device.

    train_step: one mini-batch of `shapes.micro_batches` x `shapes.micro_rows` rows, prompts
    of `shapes.prompt` and responses of `shapes.response` tokens (the trainer's padded
    widths). prefill / decode: the rollout's `shapes.rollout_rows` rows over a cache of
    `shapes.capacity` slots; the prefill writes a chunk of `shapes.prefill_chunk` tokens,
    the engine's decode call (`DecodeLoop.run`, every row decoding) samples
    `cfg.rollout.max_response_tokens` tokens in one stage over the whole cache (the last
    turn's)."""
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"programs={programs}: unknown {sorted(unknown)}; pick from {PROGRAMS}")
    m = cfg.model
    model_cfg = dataclasses.replace(model_cfg, lora=m.lora)  # the config's adapters (none for rank 0)
    module = Decoder(model_cfg, dtype=as_dtype(m.dtype), param_dtype=as_dtype(m.param_dtype), remat=m.remat,
                     policy=PLAIN)
    params = abstract_params(module, mesh)
    out = {}
    if "train_step" in programs:
        optimizer = make_optimizer(cfg.rl.optim)
        base, adapters = lora.split(params) if m.lora.rank else (None, params)
        state = abstract_state(adapters, optimizer, mesh)
        sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        step = make_train_step(module, optimizer, cfg.rl.loss, mesh, sharding_of(state),
                               temperature=cfg.rollout.logprob_temperature, horizon=cfg.rollout.max_response_length,
                               frozen_shardings=None if base is None else sharding_of(base))
        batch = _batch(mesh, shapes.micro_batches, shapes.micro_rows, shapes.prompt, shapes.response)
        frozen = () if base is None else (base,)
        out["train_step"] = Compiled.of(step.lower(state, batch, *frozen).compile(OPTIONS))

    rows = NamedSharding(mesh, P("fsdp"))
    b, v = shapes.rollout_rows, model_cfg.vocab_size
    cache = _cache(module, mesh, b, shapes.capacity)
    if "prefill" in programs:
        chunk = jax.ShapeDtypeStruct((b, shapes.prefill_chunk), jnp.int32,
                                     sharding=NamedSharding(mesh, P("fsdp", None)))
        valid = jax.ShapeDtypeStruct(chunk.shape, bool, sharding=chunk.sharding)
        out["prefill"] = Compiled.of(prefill.lower(module, params, cache, chunk, valid).compile(OPTIONS))
    if "decode" not in programs:
        return out

    replicated, matrix = NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp", None))
    a, z = STOP_AUTOMATA

    def per_row(dtype, *shape):  # [B, ...], rows over fsdp
        return jax.ShapeDtypeStruct((b, *shape), dtype, sharding=matrix if shape else rows)

    def scalar(dtype):  # [], replicated
        return jax.ShapeDtypeStruct((), dtype, sharding=replicated)

    state = DecodeState(cache=cache, logits=per_row(jnp.float32, v), live=per_row(bool), count=per_row(jnp.int32),
                        dfa=per_row(jnp.int32, a), enabled=per_row(bool, a), episode=per_row(jnp.int32),
                        drawn=per_row(jnp.int32))
    loop = DecodeLoop(module=module, sampler=cfg.rollout.sampler, max_steps=cfg.rollout.max_response_tokens,
                      windows=(shapes.capacity,))
    lowered = DecodeLoop.run.lower(
        loop, params=params, state=state, eos_ids=jax.ShapeDtypeStruct((2,), jnp.int32, sharding=replicated),
        tables=jax.ShapeDtypeStruct((a, z, v), jnp.int32, sharding=replicated),
        key=scalar(jax.eval_shape(lambda: jax.random.key(0)).dtype), min_idle=scalar(jnp.int32),
        limit=scalar(jnp.int32))
    out["decode"] = Compiled.of(lowered.compile(OPTIONS))
    return out
