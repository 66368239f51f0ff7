"""Everything a training run builds once from its config: mesh, policy and reference
params, tokenizer, tools, protocol, reward, optimizer state and the jitted steps."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

import car_jax
from car_jax.calibration.rewards import reward_fn
from car_jax.checkpoints.embedded import default_model_dir
from car_jax.data import search_tool
from car_jax.models.api import Model
from car_jax.rl.steps import (
    TrainState,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.protocols import TIR, SearchR1, car_search
from car_jax.rollout.sampling import Sampler
from car_jax.tools.python_tool import PythonTool
from car_jax.train.config import TrainConfig


@dataclasses.dataclass
class Setup:
    model: Model  # config, module, mesh, source (params live in `state`)
    tokenizer: Any
    state: TrainState
    ref_params: Any  # frozen initial policy (None when kl_coef == 0)
    train_step: Callable
    logprob_fn: Callable
    tools: dict
    protocol: Any
    reward: Callable
    episode: EpisodeConfig


def build_tools(cfg: TrainConfig) -> dict:
    """{"search": retriever} or {"code": python tool} for the configured protocol."""
    if cfg.rollout.protocol == "tir":
        return {"code": PythonTool()}
    return {"search": functools.partial(search_tool(cfg.tools.retriever), topk=cfg.tools.topk)}


PROTOCOLS = {"car_search": car_search, "search_r1": SearchR1, "tir": TIR}


def build_setup(cfg: TrainConfig) -> Setup:
    path = cfg.model.path
    if not path:
        path = str(default_model_dir())
    devices = jax.devices()[: cfg.mesh.devices or None]
    mesh = car_jax.make_mesh(cfg.mesh.fsdp, cfg.mesh.tp, devices) if len(devices) > 1 else None
    model = car_jax.load_model(path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, mesh=mesh,
                               remat=cfg.model.remat)
    tokenizer = car_jax.load_tokenizer(path)
    optimizer = make_optimizer(cfg.rl.optim)
    ref_params = jax.tree.map(jnp.copy, model.params) if cfg.rl.loss.kl_coef else None
    state = init_state(jax.tree.map(jnp.copy, model.params), optimizer, mesh)
    loss_cfg = dataclasses.replace(cfg.rl.loss, temperature=cfg.rollout.temperature or 1.0)
    step_fn = make_train_step(model.module, optimizer, loss_cfg, mesh, state_shardings(state) if mesh else None)
    r = cfg.rollout
    episode = EpisodeConfig(max_turns=r.max_turns, max_response_tokens=r.max_response_tokens,
                            max_obs_tokens=r.max_obs_tokens, tool_timeout_s=r.tool_timeout_s,
                            sampler=Sampler(r.temperature, r.top_p, r.top_k))
    model.params = None  # the policy's params live in `state` (donated each step)
    return Setup(model=model, tokenizer=tokenizer, state=state, ref_params=ref_params, train_step=step_fn,
                 logprob_fn=make_logprob_fn(model.module, loss_cfg.temperature), tools=build_tools(cfg),
                 protocol=PROTOCOLS[r.protocol](), reward=jax.jit(reward_fn(cfg.reward)), episode=episode)
