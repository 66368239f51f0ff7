"""The jitted optimizer step: `train_step(state, batch) -> (state, metrics)`.

A batch is one GRPO mini-batch split into micro-batches (`batches.micro_batches`): M
micro-batches of b response rows [M, b, R], each with its u distinct prompts [M, u, P]
run once (`logprobs.response_hidden`), with the loss fused into the vocabulary projection
(`head_loss`). Gradients of the micro-batches are summed in a `lax.scan`; the loss of
each is normalised by the whole mini-batch's token / sequence counts (`grpo.Norm`), so
the sum is exactly the mini-batch gradient. One optax update (AdamW, global-norm
clipping, warmup then constant or cosine) follows.

The state's params are what the step trains. With LoRA (`ModelConfig.lora.rank` > 0) they
are the adapters alone (`models.lora`) and the steps take the frozen base as a third
argument, `step(state, batch, base)`: the forward reads `lora.join(base, adapters)`, the
gradient, the optimizer state and the update cover the adapters only, and the base is
never differentiated, donated or copied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax.config import require
from car_jax.models import lora
from car_jax.models.decoder import Decoder
from car_jax.rl import grpo
from car_jax.rl.head_loss import HeadSpec, grpo_head_loss
from car_jax.rl.logprobs import Prompts, response_hidden, response_logprobs, unembedding

Batch = dict[str, jax.Array]
# prompt int32[M, u, P] (left-padded), prompt_valid bool[M, u, P], prompt_index int32[M, b]
# (row -> its prompt; with u == b it must be arange(b): rows are then positional and
# nothing is gathered), tokens int32[M, b, R] (responses, right-padded), valid bool[M, b, R],
# mask float32[M, b, R], old_logp / ref_logp float32[M, b, R], sampler_logp float32[M, b, R] (the
# sampler's log-probs: old_logp too unless the trainer recomputed it; read with LossConfig.tis_cap),
# advantages float32[M, b]
BATCH_KEYS = ("prompt", "prompt_valid", "prompt_index", "tokens", "valid", "mask", "old_logp", "ref_logp",
              "sampler_logp", "advantages")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    warmup_steps: int = 0
    total_steps: int = 1000  # optimizer updates the schedule spans (rl.steps x mini-batches a step x rl.epochs)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0: off

    def __post_init__(self):
        require(self.lr > 0, "lr", self.lr, "> 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        require(self.total_steps >= 1, "total_steps", self.total_steps, ">= 1")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        for f in ("b1", "b2"):
            require(0 <= getattr(self, f) < 1, f, getattr(self, f), "in [0, 1)")
        for f in ("weight_decay", "grad_clip"):
            require(getattr(self, f) >= 0, f, getattr(self, f), ">= 0")
        require(self.eps > 0, "eps", self.eps, "> 0")


@functools.lru_cache(maxsize=16)
def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and warmup; one object per config (so jitted
    steps built from equal configs are shared)."""
    warm = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    rest = max(cfg.total_steps - cfg.warmup_steps, 1)
    after = (optax.constant_schedule(cfg.lr) if cfg.schedule == "constant"
             else optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr_ratio))
    schedule = optax.join_schedules([warm, after], [cfg.warmup_steps]) if cfg.warmup_steps else after
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity(),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


@struct.dataclass
class TrainState:
    params: Any  # what is trained: the whole model's params, or with LoRA the adapters alone
    opt_state: Any
    step: jax.Array  # int32[]


def init_state(params, optimizer: optax.GradientTransformation, mesh: Mesh | None = None) -> TrainState:
    """The step-0 TrainState of `params`. With a mesh, the params keep their layout (a leaf
    not yet on the mesh is replicated over it), the optimizer state is created on the mesh
    by a jit whose outputs are laid out by `opt_state_shardings` (each AdamW moment as its
    param, so the moments are split as the sharding table splits the weights; the counters
    replicated), and the step is replicated. Without one, every leaf is committed to the
    params' device: a jitted step's outputs are, and a state that mixes committed and
    uncommitted leaves would compile the step a second time on its second call (a 10 s
    compile on CPU for a 135M model)."""
    if mesh is None:
        state = TrainState(params, jax.jit(optimizer.init)(params), jnp.zeros((), jnp.int32))
        leaf = jax.tree.leaves(params)[0]
        device = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]
        return jax.device_put(state, device)
    replicated = NamedSharding(mesh, P())
    on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh  # noqa: E731
    params_sh = jax.tree.map(lambda x: x.sharding if on_mesh(x) else replicated, params)
    params = jax.device_put(params, params_sh)
    opt_sh = opt_state_shardings(optimizer, params, params_sh, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    return TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), replicated))


def opt_state_shardings(optimizer: optax.GradientTransformation, params, params_shardings, mesh: Mesh):
    """The optimizer state's shardings for params (arrays or ShapeDtypeStructs) laid out as
    `params_shardings`: every copy of the param tree in the state (AdamW's mu and nu) takes
    the params' shardings, found by `optax.tree_map_params`; every other leaf (counts) is
    replicated over `mesh`."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
                                 params_shardings, transform_non_params=lambda _: replicated)


def state_shardings(state: TrainState):
    """The sharding of every leaf, for jit's in/out shardings."""
    return jax.tree.map(lambda x: x.sharding, state)


def _prompts(micro: Batch) -> Prompts:
    """The micro-batch's prompts, with the row -> prompt index, or None for it when prompts
    are positional (u == b)."""
    index = None if micro["prompt"].shape[0] == micro["tokens"].shape[0] else micro["prompt_index"]
    return Prompts(micro["prompt"], micro["prompt_valid"], index)


def micro_logprobs(module: Decoder, params, micro: Batch, temperature: float = 1.0, chunk: int = 128):
    """(logp, entropy) float32[b, R] of one micro-batch's responses (see BATCH_KEYS)."""
    return response_logprobs(module, params, _prompts(micro), micro["tokens"], micro["valid"],
                             temperature=temperature, chunk=chunk)


def _micro_loss(params, module: Decoder, micro: Batch, cfg: grpo.LossConfig, norm: grpo.Norm, temperature: float,
                head_grad: bool = True):
    """(loss, metrics) of one micro-batch: `grpo.grpo_loss` of its responses' log-probs at
    `temperature`, with the loss fused into the vocabulary projection (`head_loss`; without
    `head_grad`, for a frozen unembedding, its gradient is not computed)."""
    h = response_hidden(module, params, _prompts(micro), micro["tokens"], micro["valid"])
    sampler = None if cfg.tis_cap is None else micro["sampler_logp"]
    targets = grpo.LossTargets(micro["old_logp"], micro["ref_logp"], micro["advantages"], micro["mask"], sampler)
    loss, logp, entropy = grpo_head_loss(h, unembedding(module, params), micro["tokens"], targets, cfg, norm,
                                         HeadSpec(policy=module.policy, temperature=temperature, head_grad=head_grad))
    _, metrics = grpo.grpo_loss(logp, entropy, targets, cfg, norm)
    return loss, metrics


def check_frozen(module: Decoder, frozen) -> None:
    """A LoRA module's steps (their state holds the adapters) need the frozen base, a full
    one's take none: ValueError naming the fix otherwise."""
    if module.cfg.lora.rank and frozen is None:
        raise ValueError(f"model.lora.rank={module.cfg.lora.rank}: the state holds the adapters alone; pass the "
                         f"frozen base params as the step's third argument, step(state, batch, base)")
    if not module.cfg.lora.rank and frozen is not None:
        raise ValueError("a frozen base was passed to a step of a model without LoRA adapters (model.lora.rank=0); "
                         "the state's params are the whole model: call step(state, batch)")


def accumulate(module: Decoder, micro_loss, params, batch: Batch, horizon: float | None = None, frozen=None):
    """(summed grads, summed metrics, summed loss) of `micro_loss(params, micro, norm) ->
    (loss, metrics)` over the M micro-batches of one mini-batch [M, b, ...], in a
    `lax.scan`. `norm` (`grpo.Norm`) is the whole mini-batch's, so each micro-batch's loss
    and metrics are partial sums (token / sequence weighted) and their sums are exactly the
    mini-batch's values, and so is the summed gradient; its horizon is the given constant
    (Dr.GRPO's), never the batch's padded width. The GRPO and the SFT steps both
    accumulate here. With `frozen` (LoRA's base) `micro_loss` reads `lora.join(frozen,
    params)` and the gradients are those of `params` (the adapters) alone."""
    t = batch["tokens"].shape[-1]
    norm = grpo.norm_of(batch["mask"].reshape(-1, t), horizon)
    if frozen is not None:  # split like the trained params (XLA_CPU, bf16), so that the two join layer by layer
        frozen = module.policy.train_params(frozen, module.dtype)
        base_loss = micro_loss
        micro_loss = lambda p, micro, norm: base_loss(lora.join(frozen, p), micro, norm)  # noqa: E731
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(acc, micro):
        (loss, metrics), grads = grad_fn(params, micro, norm)
        acc_grads, acc_loss = acc
        return (jax.tree.map(jnp.add, acc_grads, grads), acc_loss + loss), metrics

    params = module.policy.train_params(params, module.dtype)  # XLA_CPU, bf16: split once; grads come back split
    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), batch)
    metrics = jax.tree.map(lambda m: m.sum(0), metrics)
    return module.policy.stored_grads(grads), metrics, loss


def grads_and_metrics(module: Decoder, cfg: grpo.LossConfig, params, batch: Batch, *, temperature: float = 1.0,
                      horizon: float | None = None, frozen=None):
    """(summed grads, metrics, loss) of the GRPO loss over the micro-batches of one mini-batch:
    log-probs at the rollout's `temperature`, Dr.GRPO's constant `horizon` (see
    `make_train_step`); with LoRA, gradients of the adapters `params` over the `frozen` base."""
    head_grad = frozen is None  # LoRA: the unembedding is part of the frozen base
    return accumulate(module, lambda p, micro, norm: _micro_loss(p, module, micro, cfg, norm, temperature, head_grad),
                      params, batch, horizon, frozen)


def _apply(optimizer: optax.GradientTransformation, state: TrainState, grads) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)


def make_train_step(module: Decoder, optimizer: optax.GradientTransformation, cfg: grpo.LossConfig,
                    mesh: Mesh | None = None, state_shardings=None, *, temperature: float,
                    horizon: float | None = None, frozen_shardings=None):
    """Jitted `train_step(state, batch) -> (state, metrics)`, state donated; with LoRA
    `train_step(state, batch, base)`, the state's params the adapters and `base` the frozen
    params (not donated; on a mesh in `frozen_shardings`, the table's train layout of the
    base: `sharding.params_shardings`). `temperature` is
    the rollout's log-prob temperature (`EpisodeConfig.logprob_temperature`): the step's
    log-probs use logits / temperature, as the sampler's did. `horizon` is the episode's
    maximum response length (`EpisodeConfig.max_response_length`), Dr.GRPO's constant
    divisor (needed with `seq-mean-token-sum-norm`). With a mesh, batch rows are split over
    `fsdp` and the state keeps `state_shardings`. Without one, the jitted function is shared
    by equal (module, optimizer, cfg, temperature, horizon), so a second run in the same
    process does not compile again."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use 1.0 for greedy rollouts)")
    if horizon is not None and horizon <= 0:
        raise ValueError(f"horizon={horizon} must be > 0 (the episode's maximum response length)")
    if cfg.agg == "seq-mean-token-sum-norm" and horizon is None:
        raise ValueError(grpo.NO_HORIZON)
    if mesh is None:
        return _unsharded_step(module, optimizer, cfg, temperature, horizon)
    return _build_step(module, optimizer, cfg, temperature, horizon, mesh, state_shardings, frozen_shardings)


@functools.lru_cache(maxsize=8)
def _unsharded_step(module, optimizer, cfg, temperature, horizon):
    return _build_step(module, optimizer, cfg, temperature, horizon, None, None, None)


def _frozen_in(module: Decoder, mesh: Mesh | None, frozen_shardings) -> tuple:
    """The in_shardings entry of a step's frozen base: () for a full model's 2-argument step,
    (frozen_shardings,) for a LoRA step on a mesh (needed there)."""
    if not module.cfg.lora.rank:
        return ()
    if mesh is not None and frozen_shardings is None:
        raise ValueError("a LoRA step on a mesh needs frozen_shardings (the base params' train layout: "
                         "sharding.params_shardings(base, mesh))")
    return (frozen_shardings,)


def _build_step(module, optimizer, cfg, temperature, horizon, mesh, state_shardings, frozen_shardings):

    def train_step(state: TrainState, batch: Batch, frozen=None):
        check_frozen(module, frozen)
        grads, metrics, loss = grads_and_metrics(module, cfg, state.params, batch, temperature=temperature,
                                                 horizon=horizon, frozen=frozen)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return _apply(optimizer, state, grads), metrics

    if mesh is None:
        return jax.jit(train_step, donate_argnums=0)
    batch_sh = batch_shardings(mesh)
    return jax.jit(traced_on(mesh, train_step),
                   in_shardings=(state_shardings, batch_sh, *_frozen_in(module, mesh, frozen_shardings)),
                   out_shardings=(state_shardings, None), donate_argnums=0)


def traced_on(mesh: Mesh, fn):
    """`fn` traced with `mesh` in context (`jax.sharding.use_abstract_mesh`), so that the
    forward's activation constraints (`prompt_forward.rows_constraint`: rows over fsdp, the
    sharding table's "hidden" entry) resolve on it."""
    @functools.wraps(fn)
    def on_mesh(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return on_mesh


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
    """Micro-batch rows over fsdp: [M, b, ...] -> P(None, 'fsdp', ...). On a mesh the
    prompts are positional (u == b, `host_batch.micro_plan(share=False)`), so each device
    holds its own rows' prompts and the forward gathers nothing across devices."""
    rows2, rows3 = NamedSharding(mesh, P(None, "fsdp")), NamedSharding(mesh, P(None, "fsdp", None))
    return {k: (rows2 if k in ("advantages", "prompt_index") else rows3) for k in BATCH_KEYS}


def make_logprob_fn(module: Decoder, temperature: float, chunk: int = 128, mesh: Mesh | None = None,
                    params_shardings=None):
    """Jitted (params, batch [M, b, ...] as `batches.micro_batches` lays it out) -> logp
    float32[M, b, R] (reference and old-policy log-probs, no gradient). The micro-batches
    run one after another inside one call (`lax.map`): one dispatch, and on CPU one
    temporary buffer (page-faulted in once) for the whole batch rather than one per
    micro-batch. With a mesh the pass is pinned to the train step's layout: it takes params
    in `params_shardings` (the train state's, the table's train layout) and the batch rows
    over fsdp (`batch_shardings`), and returns logp rows over fsdp, P(None, 'fsdp', None),
    so each device runs its own rows. Without one, the jitted function is shared by equal
    (module, temperature, chunk)."""
    if mesh is None:
        return _unsharded_logprob_fn(module, temperature, chunk)
    if params_shardings is None:
        raise ValueError("make_logprob_fn on a mesh needs params_shardings (the train state's params shardings)")
    return _build_logprob_fn(module, temperature, chunk, mesh, params_shardings)


@functools.lru_cache(maxsize=8)
def _unsharded_logprob_fn(module, temperature, chunk):
    return _build_logprob_fn(module, temperature, chunk, None, None)


def _build_logprob_fn(module, temperature, chunk, mesh, params_shardings):
    def fn(params, batch):
        return jax.lax.map(lambda micro: micro_logprobs(module, params, micro, temperature, chunk)[0], batch)

    if mesh is None:
        return jax.jit(fn)
    logp = NamedSharding(mesh, P(None, "fsdp", None))  # float32[M, b, R]
    return jax.jit(traced_on(mesh, fn), in_shardings=(params_shardings, batch_shardings(mesh)), out_shardings=logp)


def make_sft_step(module: Decoder, optimizer: optax.GradientTransformation, mesh: Mesh | None = None,
                  state_shardings=None, frozen_shardings=None):
    """Jitted supervised warm-start step `step(state, batch) -> (state, metrics)`, state
    donated: token-mean cross-entropy on the masked response tokens of a batch (prompt,
    prompt_valid, prompt_index, tokens, valid, mask; see BATCH_KEYS), micro-batches summed
    exactly (`accumulate`). With a mesh, as the train step: batch rows over fsdp and the
    state in and out in `state_shardings` (so the params come back in the table's layout,
    not the compiler's choice). With LoRA, `step(state, batch, base)` as the train step."""
    def micro_loss(params, micro, norm):
        logp, _ = micro_logprobs(module, params, micro)
        return -grpo.aggregate(logp, micro["mask"], "token-mean", norm), {}

    def step(state: TrainState, batch: Batch, frozen=None):
        check_frozen(module, frozen)
        grads, _, loss = accumulate(module, micro_loss, state.params, batch, frozen=frozen)
        return _apply(optimizer, state, grads), {"sft_loss": loss, "grad_norm": optax.tree.norm(grads)}

    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    if state_shardings is None:
        raise ValueError("make_sft_step on a mesh needs state_shardings (`steps.state_shardings(state)`)")
    return jax.jit(traced_on(mesh, step),
                   in_shardings=(state_shardings, batch_shardings(mesh), *_frozen_in(module, mesh, frozen_shardings)),
                   out_shardings=(state_shardings, None), donate_argnums=0)


def with_frozen(step, frozen):
    """`step(state, batch)` of a LoRA step `step(state, batch, frozen)` with its base bound
    (the call the trainer and `run_sft` make); `step` itself without a base (None)."""
    if frozen is None:
        return step

    @functools.wraps(step)
    def bound(state, batch):
        return step(state, batch, frozen)

    return bound
