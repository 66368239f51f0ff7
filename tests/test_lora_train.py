"""LoRA training: the train step differentiates and updates the adapters alone over a frozen
base (the optimizer state covers the adapters only, the base is neither changed nor
donated), a sharded LoRA step equals the one-device step, and a tiny `Trainer` run with
model.lora.rank > 0 changes only the adapters, uses the base as its KL reference (no copy),
checkpoints the adapters and their optimizer state only, resumes, and exports the merged HF
folder (which transformers loads with car_jax's LoRA logits) and the PEFT folder."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import car_jax
from car_jax import sharding as shd
from car_jax.checkpoints.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from car_jax.checkpoints.train_state import TrainCheckpointer
from car_jax.config import load_config
from car_jax.loading import load_model
from car_jax.models import lora
from car_jax.models.config import LoraConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.rl.steps import (
    OptimConfig,
    grads_and_metrics,
    init_state,
    make_optimizer,
    make_sft_step,
    make_train_step,
    state_shardings,
    with_frozen,
)
from car_jax.train.config import TrainConfig
from car_jax.train.trainer import Trainer
from tests.hf_factory import hf_logits
from tests.test_multihost import tiny_folder  # noqa: F401 (the fixture)
from tests.test_train_step import CFG, STEP_LOSS, make_batch, place

LORA_CFG = dataclasses.replace(CFG, lora=LoraConfig(rank=4, alpha=8.0))
# No warmup: the first update moves the adapters. eps = 1e-6, not optax's 1e-8: Adam's first step
# is lr g / (|g| + eps), so an element whose gradient is near eps can turn the different summation
# order of the sharded and the unsharded step into an update difference far above the gradients'
# own: with eps = 1e-8, one k_lora_b element differed by 2.2e-5 at fsdp = 8 on one machine; its
# gradient was about 4e-9 (g / (|g| + eps) = -0.2976 unsharded, -0.2954 sharded, read back from
# the updated parameter), so a 0.7% summation difference in a near-zero gradient moved the update
# by lr x 0.0022. At 1e-6 the step's sensitivity to gradient noise is at most lr / eps, and every
# parameter is still compared at 1e-5.
OPTIM = OptimConfig(lr=1e-2, total_steps=10, eps=1e-6)


@pytest.fixture(scope="module")
def tiny_lora():
    """(module, base, adapters) of the train-step tests' tiny Qwen2 with LoRA on every
    target; B random (not zero), so every adapter has a gradient in the first step."""
    module = Decoder(LORA_CFG)
    base, adapters = lora.split(module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.05, x.shape), jnp.float32), adapters)
    return module, base, adapters


def test_lora_step_trains_the_adapters_alone(tiny_lora):
    """The step's gradient is the gradient of the adapters (the joined forward's, taken
    w.r.t. the adapters), the optimizer state mirrors the adapters, the base comes out
    unchanged and still usable (not donated), and a full model's step refuses a base."""
    module, base, adapters = tiny_lora
    opt = make_optimizer(OPTIM)
    batch = make_batch(micro=4, sampler_gap=0.5)
    step = make_train_step(module, opt, STEP_LOSS, temperature=1.0)
    before = jax.tree.map(np.asarray, base)
    state = init_state(jax.tree.map(jnp.copy, adapters), opt)
    adam = state.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(adapters)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) < 3 * sum(x.size for x in jax.tree.leaves(adapters))
    new, metrics = step(state, batch, base)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(base)))
    for (path, a), b in zip(shd.flatten_params(adapters).items(), jax.tree.leaves(new.params)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4, path  # every adapter moved
    # the step's gradient norm is that of the joined forward's gradient w.r.t. the adapters
    grads, _, _ = jax.jit(lambda ad: grads_and_metrics(module, STEP_LOSS, ad, batch, frozen=base))(adapters)
    full = jax.jit(lambda p: grads_and_metrics(module, STEP_LOSS, p, batch)[0])(lora.join(base, adapters))
    _, from_joined = lora.split(full)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(from_joined)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert abs(float(metrics["grad_norm"]) - float(optax.tree.norm(grads))) <= 1e-5 * float(metrics["grad_norm"])
    with pytest.raises(ValueError, match="frozen base"):
        step(init_state(jax.tree.map(jnp.copy, adapters), opt), batch)
    with pytest.raises(ValueError, match="lora.rank=0"):
        make_train_step(Decoder(CFG), opt, STEP_LOSS, temperature=1.0)(init_state(base, opt), batch, base)


def test_lora_step_in_bf16_under_the_cpu_policy(tiny_lora):
    """bf16 compute under the CPU policy splits the base and the adapters per layer (its
    Python loop) and joins them layer by layer: the adapters' gradients are the scan's
    (the plain policy). The two graphs round their bf16 intermediates at different places,
    hence the 2% tolerance (as tests/test_train_step.py's loop-vs-scan test)."""
    module, base, adapters = tiny_lora
    batch = make_batch(micro=4)
    grads = {}
    for name, policy in (("loop", XLA_CPU), ("scan", PLAIN)):
        m = dataclasses.replace(module, dtype=jnp.bfloat16, policy=policy)
        assert isinstance(policy.train_params(base, m.dtype)["layers"], tuple) == (name == "loop")
        grads[name] = jax.jit(lambda ad, m=m: grads_and_metrics(m, STEP_LOSS, ad, batch, frozen=base)[0])(adapters)
    assert jax.tree.structure(grads["loop"]) == jax.tree.structure(adapters)
    for a, b in zip(jax.tree.leaves(grads["loop"]), jax.tree.leaves(grads["scan"])):
        scale = float(jnp.abs(b).max())
        assert scale > 1e-4
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2 * scale)


@pytest.mark.parametrize("mesh_shape", [None, (4, 2)], ids=["one-device", "4x2"])
def test_lora_sft_step_lowers_the_loss_over_a_frozen_base(tiny_lora, mesh_shape):
    """The SFT warm start's step with LoRA (the trainer binds the base: `with_frozen`) lowers
    the loss by training the adapters from their step-0 init (B zero), the base untouched.
    The frozen unembedding is scaled up (std 0.5): at the init's 0.02, logits of the
    normalised hidden states stay within about +-0.6 whatever the adapters do."""
    module, base, _ = tiny_lora
    base = {**base, "lm_head": base["lm_head"] * 25.0}
    opt = make_optimizer(OptimConfig(lr=1e-2, total_steps=20))
    mesh = None if mesh_shape is None else car_jax.make_mesh(fsdp=mesh_shape[0], tp=mesh_shape[1])
    adapters = lora.init_adapters(LORA_CFG, jax.random.key(1), mesh)
    frozen = base if mesh is None else place(base, mesh)
    state = init_state(adapters, opt, mesh)
    step = make_sft_step(module, opt, mesh, state_shardings(state) if mesh else None,
                         frozen_shardings=shd.params_shardings(base, mesh) if mesh else None)
    step = with_frozen(step, frozen)
    data = make_batch(n=4, micro=4, share=mesh is None, mesh=mesh)
    losses = []
    for _ in range(12):
        state, m = step(state, data)
        losses.append(float(m["sft_loss"]))
    assert losses[-1] < 0.2 * losses[0]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(base),
                                                                             jax.tree.leaves(frozen)))
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)


@pytest.mark.parametrize("fsdp,tp", [(4, 2), (8, 1)])
def test_sharded_lora_step_equals_unsharded(tiny_lora, fsdp, tp):
    module, base, adapters = tiny_lora
    opt = make_optimizer(OPTIM)
    micro = max(4, fsdp)  # rows of a micro-batch split over fsdp
    plain = make_train_step(module, opt, STEP_LOSS, temperature=1.0)
    s1, m1 = plain(init_state(jax.tree.map(jnp.copy, adapters), opt), make_batch(micro=micro, sampler_gap=0.5), base)

    mesh = car_jax.make_mesh(fsdp=fsdp, tp=tp)
    sharded_base = place(base, mesh)
    state = init_state(place(jax.tree.map(jnp.copy, adapters), mesh), opt, mesh)
    step = make_train_step(module, opt, STEP_LOSS, mesh, state_shardings(state), temperature=1.0,
                           frozen_shardings=shd.params_shardings(base, mesh))
    s2, m2 = step(state, make_batch(micro=micro, share=False, mesh=mesh, sampler_gap=0.5), sharded_base)
    for path, x in shd.flatten_params(s2.params).items():
        assert lora.is_adapter(path)
        assert x.sharding.is_equivalent_to(shd.param_sharding(path, x.shape, mesh), x.ndim)
    diff = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), s1.params, s2.params)
    assert max(jax.tree.leaves(diff)) <= 1e-5
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), adapters, s2.params)
    assert min(jax.tree.leaves(moved)) > 1e-4
    for k in m1:
        assert abs(float(m1[k]) - float(m2[k])) <= 1e-5, k
    assert int(s2.step) == 1
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(sharded_base)))


def lora_args(folder, run_dir, steps) -> list[str]:
    """Tiny random model, world data (4 prompts x G = 2), greedy, one process, LoRA rank 4 on
    every target, KL on; the random model's rewards are all equal (no format), so the
    entropy bonus moves the adapters; a checkpoint every step."""
    return [f"model.path={folder}", f"run.dir={run_dir}", f"rl.steps={steps}", "rl.prompts_per_step=4",
            "rollout.group_size=2", "rollout.max_turns=0", "rollout.max_response_tokens=4", "rollout.temperature=0",
            "data.limit=40", "sft.steps=0", "run.loggers=[]", "mesh.devices=1", "run.checkpoint_every=1",
            "model.lora.rank=4", "model.lora.alpha=8", "rl.loss.kl_coef=0.01", "rl.loss.entropy_coef=0.1",
            "rl.optim.lr=0.05", "rl.optim.warmup_steps=0"]


def test_lora_trainer_run(tiny_folder, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, lora_args(tiny_folder, run_dir, 2))
    trainer = Trainer(cfg)
    s = trainer.setup
    assert s.ref_params is s.frozen  # the reference is the base itself, adapters off: no copy
    start = jax.tree.map(np.asarray, s.state.params)
    assert {p for p in shd.flatten_params(start)} == {p.path for p in lora.declarations(s.model.config)}
    trainer.run()
    base = load_model(tiny_folder).params
    for path, x in shd.flatten_params(base).items():  # the base, bit for bit
        assert np.array_equal(np.asarray(shd.flatten_params(s.frozen)[path]), np.asarray(x)), path
    trained = jax.tree.map(np.asarray, s.state.params)
    assert max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start))) > 1e-4

    # the checkpoint holds the adapters, their AdamW moments and the step: no base weight
    with TrainCheckpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        tree, _ = ckpt.restore(2)
    saved = shd.flatten_params(tree["params"])
    assert set(saved) == {p for p in shd.flatten_params(start)} and all(lora.is_adapter(p) for p in saved)
    n_base = sum(x.size for x in jax.tree.leaves(base))
    n_saved = sum(np.asarray(x).size for x in jax.tree.leaves(tree))
    assert n_saved < 3.1 * sum(x.size for x in jax.tree.leaves(trained)) < n_base
    for path, x in saved.items():
        assert np.array_equal(np.asarray(x), shd.flatten_params(trained)[path]), path

    # the exports: merged HF weights with car_jax's LoRA logits, and the PEFT folder
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 49152, (2, 9))
    module = Decoder(s.model.config, policy=PLAIN)
    ours = module.apply({"params": lora.join(base, s.state.params)}, jnp.asarray(tokens, jnp.int32))[0]
    np.testing.assert_allclose(hf_logits(hf, tokens), np.asarray(ours), atol=1e-4)
    assert (run_dir / "peft" / ADAPTER_CONFIG).is_file() and (run_dir / "peft" / ADAPTER_WEIGHTS).is_file()

    # resume: a longer run in the same folder starts from step 2's adapters and moments
    resumed = Trainer(load_config(TrainConfig, None, lora_args(tiny_folder, run_dir, 3)))
    assert resumed.start_step == 2 and resumed.data_pos == trainer.data_pos
    for a, b in zip(jax.tree.leaves(resumed.setup.state), jax.tree.leaves(s.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    rows = resumed.run()
    assert [r["step"] for r in rows] == [3]
    with TrainCheckpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        assert ckpt.latest_step() == 3


def test_lora_trainer_step_on_a_mesh(tiny_folder, tmp_path):  # noqa: F811
    """One LoRA step on the 4 x 2 mesh, with the reference pass (the base alone) and the
    recomputed old log-probs (base + adapters): the adapters and their moments are laid out
    by the sharding table, the base is unchanged, and the old log-probs equal the
    sampler's at step 1 (the same policy, so the logged mismatch is rounding)."""
    args = [a for a in lora_args(tiny_folder, tmp_path / "run", 1) if not a.startswith("mesh.")]
    cfg = load_config(TrainConfig, None, [*args, "mesh.fsdp=4", "mesh.tp=2", "rl.recompute_old_logp=true",
                                          "run.export_hf=false"])
    trainer = Trainer(cfg)
    s = trainer.setup
    mesh = s.model.mesh
    assert mesh is not None and s.ref_params is s.frozen
    before = jax.tree.map(np.asarray, s.frozen)
    rows = trainer.run()
    assert rows[0]["mismatch/abs_dlogp"] < 1e-4
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(s.frozen)):
        assert np.array_equal(a, np.asarray(b))
    for path, x in shd.flatten_params(s.state.params).items():
        assert x.sharding.is_equivalent_to(shd.param_sharding(path, x.shape, mesh), x.ndim), path
    for path, x in shd.flatten_params(s.state.opt_state[1][0].mu).items():
        assert x.sharding.is_equivalent_to(shd.param_sharding(path, x.shape, mesh), x.ndim), path
