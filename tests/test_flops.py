"""The step's model FLOPs (`train.flops`) against matmuls counted by hand from the model's
own parameter shapes, the chip table, and the trainer's perf metrics."""
import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.models.policy import device_kind
from car_jax.rl.grpo import LossConfig
from car_jax.rl.host_batch import host_batch
from car_jax.rollout.episode import Trajectory
from car_jax.train import flops
from car_jax.train.config import RLConfig, TrainConfig
from car_jax.train.trainer import Trainer

# GQA (N = 6 query heads, K = 2 kv heads), biases, untied head
CFG = ModelConfig("qwen2", vocab_size=50, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=4,
                  mlp_dim=40, qkv_bias=True)


def _matmul(a: tuple[int, int], b: tuple[int, int]) -> int:
    """FLOPs of [m, k] @ [k, n]: one multiply and one add per product."""
    assert a[1] == b[0]
    return 2 * a[0] * a[1] * b[1]


def _hand_forward(n: int) -> int:
    """One sequence of n tokens, every token attending all n keys (PaLM's convention) and
    projected to the vocabulary: each layer's matmuls from the Decoder's own weight shapes,
    and the attention's two products per query head."""
    shapes = jax.eval_shape(Decoder(CFG).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    total = 0
    for name in ("q", "k", "v", "o"):
        w = shapes["layers"]["attn"][name].shape[1:]  # without the stacked L axis
        n_in = 2 if name == "o" else 1
        total += _matmul((n, math.prod(w[:n_in])), (math.prod(w[:n_in]), math.prod(w[n_in:])))
    for name in ("gate", "up", "down"):
        total += _matmul((n, shapes["layers"]["mlp"][name].shape[1]), shapes["layers"]["mlp"][name].shape[1:])
    h = CFG.head_dim
    total += CFG.n_heads * (_matmul((n, h), (h, n)) + _matmul((n, n), (n, h)))  # q k^T, then p v
    total *= CFG.n_layers
    return total + _matmul((n, CFG.d_model), shapes["lm_head"].shape)


def test_forward_flops_count_the_models_matmuls():
    for n in (1, 7, 32):
        assert flops.forward_flops(CFG, n, n, n * n) == _hand_forward(n)
    # no logits for half the tokens: the head's matmul for half of them
    assert flops.forward_flops(CFG, 8, 4, 64) == _hand_forward(8) - _matmul((4, CFG.d_model), (CFG.d_model, 50))


def test_the_update_and_rollout_counts():
    """Two distinct prompts (2 and 3 valid tokens, left-padded); rows 0, 1 continue prompt 0,
    row 2 prompt 1, with 2, 1 and 3 valid response tokens."""
    prompts_valid = np.array([[False, True, True], [True, True, True]])
    valid = np.array([[True, True, False], [True, False, False], [True, True, True]])
    tokens, logits, pairs = flops.update_counts(prompts_valid, np.array([0, 0, 1]), valid)
    assert (tokens, logits) == (2 + 3 + 2 + 1 + 3, 2 + 1 + 3)
    assert pairs == 2 * 2 + 3 * 3 + 2 * (2 + 2) + 1 * (2 + 1) + 3 * (3 + 3)
    assert flops.rollout_counts([3, 5], [4, 2], [3, 1]) == (14, 4, 49 + 49)
    update, rollout = (10, 6, 40), (14, 4, 98)
    want = (3 * 2 + 1) * flops.forward_flops(CFG, *update) + flops.forward_flops(CFG, *rollout)
    assert flops.step_flops(CFG, update, rollout, epochs=2, logprob_passes=1) == want


def test_the_chip_table():
    kinds = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e",
             "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200"}
    for kind, name in kinds.items():
        assert flops.chip(kind).name == name, kind
    assert flops.chip("TPU v5 lite").peak_bf16_flops == 197e12 and flops.chip("NVIDIA H200").peak_bf16_flops == 989e12
    assert flops.chip("cpu") is None and flops.chip(device_kind()) is None  # the tests run on the CPU
    perf = flops.perf_metrics(2e15, 2.0, 4, "NVIDIA H100 80GB HBM3")
    assert perf["perf/model_tflops_per_device"] == 250.0
    assert abs(perf["perf/mfu"] - 250e12 / 989e12) < 1e-12
    assert math.isnan(flops.perf_metrics(2e15, 2.0, 4, "cpu")["perf/mfu"])


def test_the_trainer_logs_the_steps_perf():
    """`Trainer._perf_metrics` on a step of 4 trajectories (2 prompts x 2), KL on, old
    log-probs recomputed, 2 epochs: the step's model FLOPs over the time and the devices."""
    trajs = [Trajectory([1, 2, 3], [4, 5, 6, 7], np.zeros(4), [True, True, False, True]),
             Trajectory([1, 2, 3], [4, 5], np.zeros(2), [True, True]),
             Trajectory([9, 8], [4], np.zeros(1), [True]),
             Trajectory([9, 8], [4, 5, 6], np.zeros(3), [True, True, True])]
    host = host_batch(trajs, 0)
    rl = dataclasses.replace(RLConfig(), epochs=2, recompute_old_logp=True, loss=LossConfig(kl_coef=0.01))
    trainer = SimpleNamespace(cfg=dataclasses.replace(TrainConfig(), rl=rl),
                              setup=SimpleNamespace(model=SimpleNamespace(config=CFG, mesh=None)))
    perf = Trainer._perf_metrics(trainer, trajs, host, 0.5)
    assert set(perf) == {"perf/model_tflops_per_device", "perf/mfu"}
    # update: prompts of 3 and 2 tokens once, responses of 4, 2, 1, 3
    update = (3 + 2 + 4 + 2 + 1 + 3, 4 + 2 + 1 + 3, 9 + 4 + 4 * 7 + 2 * 5 + 1 * 3 + 3 * 5)
    rollout = (7 + 5 + 3 + 5, 3 + 2 + 1 + 3, 49 + 25 + 9 + 25)
    want = (3 * 2 + 2) * flops.forward_flops(CFG, *update) + flops.forward_flops(CFG, *rollout)
    assert abs(perf["perf/model_tflops_per_device"] - want / 0.5 / 1e12) <= 1e-9 * want / 1e12
    assert math.isnan(perf["perf/mfu"])  # the CPU has no peak
