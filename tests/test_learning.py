"""GRPO learns: a tiny random model is trained to answer one fixed 2-token string."""
import jax
import jax.numpy as jnp
import numpy as np

from car_jax.calibration.rewards import RewardConfig, RewardInputs, reward_fn
from car_jax.loading import Model
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.rl import grpo
from car_jax.rl.batches import make_scorer, micro_batches, to_device
from car_jax.rl.host_batch import micro_plan
from car_jax.rl.steps import OptimConfig, init_state, make_optimizer, make_train_step
from car_jax.rollout.generate import generate_ids
from car_jax.rollout.sampling import Sampler
from tests.hf_factory import StubTokenizer
from tests.single_turn import single_turn_batch

VOCAB = 6
TARGET = [4, 2]  # a random policy says it with probability 1/36


def test_grpo_lifts_reward_on_a_toy_task():
    cfg = ModelConfig("llama", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      mlp_dim=64)
    module = Decoder(cfg)
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]  # one compile
    opt = make_optimizer(OptimConfig(lr=1e-2, total_steps=100, weight_decay=0.0))
    state = init_state(params, opt)
    step_fn = make_train_step(module, opt, grpo.LossConfig(kl_coef=0.0), temperature=1.0)
    score = make_scorer(reward_fn(RewardConfig(kind="binary")))  # reward = correct
    prompts = [[1, 3, 5], [2, 2], [5, 1, 1, 3], [3]]
    group = 16
    curve = []
    for step in range(40):
        policy = Model(cfg, state.params, module)
        ids = [p for p in prompts for _ in range(group)]
        out = generate_ids(policy, StubTokenizer(VOCAB), ids, max_new_tokens=2, sampler=Sampler(1.0), seed=step,
                           eos=np.array([], np.int32))
        rewards = np.array([float(list(out.tokens[i, :2]) == TARGET) for i in range(len(ids))])
        curve.append(rewards.mean())
        if step >= 5 and np.mean(curve[-3:]) > 0.8:
            break
        inputs = RewardInputs(rewards == 1.0, np.zeros(len(ids), np.float32), np.ones(len(ids), bool))
        host = single_turn_batch(ids, out, 0, inputs, np.repeat(np.arange(len(prompts)), group))
        batch, _ = score(to_device(host))
        state, _ = step_fn(state, micro_batches(batch, micro_plan(host.prompt_of, np.arange(len(ids)), len(ids))))
    assert np.mean(curve[:3]) < 0.3
    assert np.mean(curve[-3:]) > 0.8, curve
