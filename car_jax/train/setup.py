"""Everything a training run builds once from its config: mesh, policy and reference
params, tokenizer, tools, protocol, the device-side scorer, optimizer state and the jitted
steps.

With `model.lora.rank` > 0 the loaded weights are the frozen base (`Setup.frozen`), the
train state holds the adapters alone (`models.lora.init_adapters`: A kaiming-uniform, B
zeros, so step 0 is the base model), and the KL reference is the base itself, adapters off:
no copy of the weights is made."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import car_jax
from car_jax.calibration.rewards import overlong_fn, reward_fn
from car_jax.checkpoints.hub import resolve_model_path
from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.checkpoints.sources import check_model_path
from car_jax.config import ConfigError
from car_jax.data.chat_tools import check_tool_template
from car_jax.loading import Model
from car_jax.models import lora
from car_jax.models.config import UnsupportedConfigError
from car_jax.rl.batches import make_scorer
from car_jax.rl.steps import (
    TrainState,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    state_shardings,
    with_frozen,
)
from car_jax.rollout.protocols import PROTOCOLS
from car_jax.rollout.toolbox import Toolbox, open_tools, tool_names
from car_jax.sharding import MeshConfig, params_shardings
from car_jax.train.config import PolicyConfig, TrainConfig


@dataclasses.dataclass
class Setup:
    model: Model  # config, module, mesh, source (params live in `state`, with LoRA the base in `frozen`)
    tokenizer: Any
    state: TrainState  # its params: the policy's, or with LoRA its adapters
    ref_params: Any  # frozen initial policy (None when kl_coef == 0); with LoRA the base (+ SFT's adapters)
    train_step: Callable  # train_step(state, batch) (with LoRA the base is bound: `steps.with_frozen`)
    logprob_fn: Callable  # (policy params, batch) -> logp; the policy params are `policy_params()`
    score: Callable  # TrainBatch -> (TrainBatch with advantages, rewards), on the device
    toolbox: Toolbox
    protocol: Any
    frozen: Any = None  # LoRA: the frozen base params (never updated, donated or copied); None: full training
    ref_logprob_fn: Callable | None = None  # logprob_fn for the reference's tree (None: logprob_fn's)

    def policy_params(self, trained=None):
        """The params the forward reads: the state's (or `trained`), joined onto the frozen
        base with LoRA (`lora.join`: no copy)."""
        return lora.join(self.frozen, self.state.params if trained is None else trained)

    def set_reference(self, trained, copy: bool = True) -> None:
        """The KL reference after a warm start: the trained params (a copy unless `copy` is
        off; with LoRA only the adapters, joined onto the base), read by the policy's
        log-prob pass."""
        self.ref_params = self.policy_params(jax.tree.map(jnp.copy, trained) if copy else trained)
        self.ref_logprob_fn = self.logprob_fn

    def frozen_shardings(self):
        """The frozen base's train layout on the mesh (None without a mesh or without LoRA)."""
        mesh = self.model.mesh
        return params_shardings(self.frozen, mesh) if mesh is not None and self.frozen is not None else None


def build_mesh(cfg: MeshConfig) -> Mesh | None:
    """The (fsdp, tp) mesh over the configured devices; None with one device. Asking for more
    devices than there are is a ConfigError naming mesh.devices (`MeshConfig.pick`), and so
    is a mesh that leaves out a process of a multi-process run (`hosts.check_mesh`)."""
    return cfg.build()


def load_policy(cfg: PolicyConfig, mesh: Mesh | None):
    """(model, tokenizer) from the configured path ("" = the embedded SmolLM2,
    `embedded.TINY_RANDOM` the tiny random model, a hub id such as Qwen/Qwen2.5-3B-Instruct
    is fetched into the HF cache: `checkpoints.hub`). A path that is none of these or holds no
    model (checked before anything loads), no tokenizer or a damaged checkpoint is a
    ConfigError naming model.path."""
    try:
        path = str(resolve_model_path(cfg.path))
    except CheckpointError as err:
        raise ConfigError(f"model.path={err}") from None
    try:
        check_model_path(path)
    except CheckpointError as err:
        raise ConfigError(f"model.path: {err}") from None
    try:
        tokenizer = car_jax.load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: cannot load a tokenizer from {path} ({err}); the policy's folder must "
                          f"hold its tokenizer too") from None
    try:
        model = car_jax.load_model(path, dtype=cfg.dtype, param_dtype=cfg.param_dtype, mesh=mesh, remat=cfg.remat)
    except (CheckpointError, UnsupportedConfigError) as err:
        raise ConfigError(f"model.path: {err}") from None
    if cfg.lora.rank:  # the module runs the adapters of model.lora; the loaded params are the base
        config = dataclasses.replace(model.config, lora=cfg.lora)
        model = dataclasses.replace(model, config=config, module=model.module.clone(cfg=config))
    return model, tokenizer


def overlong(cfg: TrainConfig):
    """The reward's overlong shaping for this rollout (`rewards.overlong_fn`; None: off),
    L_max by default an episode's budget of model-written tokens,
    (max_turns + 1) x max_response_tokens."""
    return overlong_fn(cfg.reward.overlong, (cfg.rollout.max_turns + 1) * cfg.rollout.max_response_tokens)


def build_setup(cfg: TrainConfig) -> Setup:
    mesh = build_mesh(cfg.mesh)
    model, tokenizer = load_policy(cfg.model, mesh)
    protocol, tool_kind = PROTOCOLS[cfg.rollout.protocol]
    if cfg.rollout.protocol == "qwen":  # native tool calls: the chat template must list the tools
        try:
            check_tool_template(tokenizer, tool_names(tool_kind), f"rollout.protocol={cfg.rollout.protocol!r}")
        except ValueError as err:
            raise ConfigError(f"model.path: {err}") from None
    optimizer = make_optimizer(cfg.rl.optim)
    if cfg.model.lora.rank:  # the base stays as loaded (frozen, and the reference: no copy); the adapters train
        frozen = model.params
        ref_params = frozen if cfg.rl.loss.kl_coef else None
        state = init_state(lora.init_adapters(model.config, jax.random.key(cfg.seed), mesh), optimizer, mesh)
    else:
        frozen = None
        ref_params = jax.tree.map(jnp.copy, model.params) if cfg.rl.loss.kl_coef else None
        state = init_state(jax.tree.map(jnp.copy, model.params), optimizer, mesh)
    frozen_sh = params_shardings(frozen, mesh) if mesh and frozen is not None else None
    # the log-prob temperature of the rollout: the sampler's, the train step's and the
    # reference / old-policy passes' (one source, the episode config); Dr.GRPO's horizon is
    # the episode config's too (its maximum response length), not a batch's padded width
    temperature = cfg.rollout.logprob_temperature
    step_fn = make_train_step(model.module, optimizer, cfg.rl.loss, mesh, state_shardings(state) if mesh else None,
                              temperature=temperature, horizon=cfg.rollout.max_response_length,
                              frozen_shardings=frozen_sh)
    model.params = None  # the policy's params live in `state` (donated each step), with LoRA's base in `frozen`
    policy_sh = lora.join(frozen_sh, state_shardings(state).params) if mesh else None
    logprob_fn = make_logprob_fn(model.module, temperature, mesh=mesh, params_shardings=policy_sh)
    ref_logprob_fn = (make_logprob_fn(model.module, temperature, mesh=mesh, params_shardings=frozen_sh)
                      if frozen is not None and mesh else logprob_fn)  # LoRA's reference: the base alone
    return Setup(model=model, tokenizer=tokenizer, state=state, ref_params=ref_params,
                 train_step=with_frozen(step_fn, frozen), logprob_fn=logprob_fn,
                 score=make_scorer(reward_fn(cfg.reward), cfg.rl.adv_std_norm, mesh, shaping=overlong(cfg)),
                 toolbox=open_tools(tool_kind, cfg.tools), protocol=protocol(), frozen=frozen,
                 ref_logprob_fn=ref_logprob_fn)
