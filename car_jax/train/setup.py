"""Everything a training run builds once from its config: mesh, policy and reference
params, tokenizer, tools, protocol, the device-side scorer, optimizer state and the jitted
steps."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import car_jax
from car_jax.calibration.rewards import reward_fn
from car_jax.checkpoints.hub import resolve_model_path
from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.checkpoints.sources import check_model_path
from car_jax.config import ConfigError
from car_jax.loading import Model
from car_jax.models.config import UnsupportedConfigError
from car_jax.rl.batches import make_scorer
from car_jax.rl.steps import (
    TrainState,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from car_jax.rollout.protocols import PROTOCOLS
from car_jax.rollout.toolbox import Toolbox, open_tools
from car_jax.sharding import MeshConfig
from car_jax.train.config import PolicyConfig, TrainConfig


@dataclasses.dataclass
class Setup:
    model: Model  # config, module, mesh, source (params live in `state`)
    tokenizer: Any
    state: TrainState
    ref_params: Any  # frozen initial policy (None when kl_coef == 0)
    train_step: Callable
    logprob_fn: Callable
    score: Callable  # TrainBatch -> (TrainBatch with advantages, rewards), on the device
    toolbox: Toolbox
    protocol: Any


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
    return model, tokenizer


def build_setup(cfg: TrainConfig) -> Setup:
    mesh = build_mesh(cfg.mesh)
    model, tokenizer = load_policy(cfg.model, mesh)
    optimizer = make_optimizer(cfg.rl.optim)
    ref_params = jax.tree.map(jnp.copy, model.params) if cfg.rl.loss.kl_coef else None
    state = init_state(jax.tree.map(jnp.copy, model.params), optimizer, mesh)
    # the log-prob temperature of the rollout: the sampler's, the train step's and the
    # reference / old-policy passes' (one source, the episode config); Dr.GRPO's horizon is
    # the episode config's too (its maximum response length), not a batch's padded width
    temperature = cfg.rollout.logprob_temperature
    step_fn = make_train_step(model.module, optimizer, cfg.rl.loss, mesh, state_shardings(state) if mesh else None,
                              temperature=temperature, horizon=cfg.rollout.max_response_length)
    protocol, tool_kind = PROTOCOLS[cfg.rollout.protocol]
    model.params = None  # the policy's params live in `state` (donated each step)
    return Setup(model=model, tokenizer=tokenizer, state=state, ref_params=ref_params, train_step=step_fn,
                 logprob_fn=make_logprob_fn(model.module, temperature, mesh=mesh,
                                            params_shardings=state_shardings(state).params if mesh else None),
                 score=make_scorer(reward_fn(cfg.reward), cfg.rl.adv_std_norm, mesh),
                 toolbox=open_tools(tool_kind, cfg.tools), protocol=protocol())
