"""The planner with LoRA (model.lora.rank > 0): the base in its storage dtype plus the float32
adapters, gradients and AdamW moments of the adapters only, no reference copy; and on
Qwen2.5-7B-Instruct's architecture the per-device bytes of the train step and of the rollout
programs within 15% of XLA's `memory_analysis()` of the real compiled LoRA programs (fake
CPU mesh, no weights)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.config import load_config
from car_jax.models import lora
from car_jax.models.config import LoraConfig
from car_jax.models.decoder import Decoder
from car_jax.plan import make_plan, model_config
from car_jax.plan.xla import abstract_params, fake_mesh, xla_memory
from car_jax.train.config import TrainConfig
from tests.test_plan import SMALL, TINY


def shard_bytes(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_lora_bytes_by_hand():
    """params: the bf16 base plus the float32 adapters as jax lays them out on the mesh;
    gradients and moments: twice the adapters' bytes each; no reference; the base's counts
    are those of the same config without LoRA."""
    mesh = fake_mesh(2, 2)
    cfg = load_config(TrainConfig, None, [*SMALL, "model.param_dtype=bfloat16", "model.lora.rank=8"])
    module = Decoder(dataclasses.replace(TINY, lora=cfg.model.lora), param_dtype=jnp.bfloat16)
    base, adapters = lora.split(abstract_params(module, mesh))
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {np.dtype(np.float32)}
    plan = make_plan(cfg, 2, 2, "v5e", prompt_tokens=64, model=TINY)
    assert plan.params_bytes == shard_bytes(base) + shard_bytes(adapters)
    assert plan.grads_bytes == plan.opt_state_bytes == 2 * shard_bytes(adapters)
    assert plan.ref_bytes == 0  # KL on (the default), against the base itself
    full = make_plan(load_config(TrainConfig, None, [*SMALL, "model.param_dtype=bfloat16"]), 2, 2, "v5e",
                     prompt_tokens=64, model=TINY)
    assert full.params_bytes == shard_bytes(base) and full.ref_bytes == full.params_bytes
    assert plan.shapes == full.shapes and plan.kv_cache_bytes == full.kv_cache_bytes


# Qwen2.5-7B-Instruct with rank-16 adapters on every target, 8 rows of 64 + 64 tokens a
# micro-batch, on 4 x 2 devices. float32 storage and compute: XLA:CPU keeps float32 copies of
# bf16 programs' operands (README, "Will it fit?"), so its accounting of a bf16 step says
# more about XLA:CPU than about an accelerator.
QWEN7B = ["model.path=Qwen/Qwen2.5-7B-Instruct", "model.lora.rank=16", "model.lora.alpha=32", "model.dtype=float32",
          "model.param_dtype=float32", "rollout.group_size=4", "rl.prompts_per_step=4", "rl.micro_batch=8",
          "rollout.max_turns=0", "rollout.max_response_tokens=64", "rollout.max_obs_tokens=32"]


@pytest.mark.parametrize("fsdp,tp,overrides", [
    (4, 2, ["model.remat=true"]),
    (8, 1, ["model.remat=false"]),
], ids=["4x2-remat", "8x1-no-remat"])
def test_lora_plan_of_qwen25_7b_agrees_with_xla(fsdp, tp, overrides):
    cfg = load_config(TrainConfig, None, [*QWEN7B, *overrides])
    model = model_config(cfg.model.path)
    assert (model.d_model, model.n_layers, model.vocab_size) == (3584, 28, 152064)
    plan = make_plan(cfg, fsdp, tp, "h100", prompt_tokens=64, model=model)
    xla = xla_memory(cfg, model, fake_mesh(fsdp, tp), plan.shapes)
    step = plan.params_bytes + plan.opt_state_bytes + plan.grads_bytes + plan.train_gathered_bytes \
        + plan.activation_bytes
    assert step == pytest.approx(xla["train_step"].peak, rel=0.15)
    assert plan.train_bytes == step + plan.batch_bytes
    # the step's arguments: the state (adapters and their moments) and the frozen base
    assert xla["train_step"].argument == pytest.approx(plan.params_bytes + plan.opt_state_bytes, rel=0.02)
    prefill = plan.params_bytes + plan.gathered_bytes + plan.kv_cache_bytes + plan.rollout_temp_bytes
    assert prefill == pytest.approx(xla["prefill"].peak, rel=0.15)
    # the moments of rank-16 adapters beside full fine-tuning's, per device: more than 25x smaller
    # (the B factors of q, k, v, gate and up, [r, out] with out over tp, are whole on every fsdp
    # device: 31x on 8x1, 56x on 4x2; over all devices the adapters are 0.5% of the weights)
    full = make_plan(load_config(TrainConfig, None, [*QWEN7B, *overrides, "model.lora.rank=0"]), fsdp, tp, "h100",
                     prompt_tokens=64, model=model)
    assert 25 * plan.opt_state_bytes < full.opt_state_bytes


def test_lora_config_defaults_to_every_target():
    cfg = load_config(TrainConfig, None, [*QWEN7B])
    assert cfg.model.lora == LoraConfig(rank=16, alpha=32.0)
