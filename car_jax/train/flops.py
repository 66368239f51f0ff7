"""Model FLOPs of a training step, the chips' peak FLOP/s, and the step's MFU.

The formula (model FLOPs: the matmuls the model needs, whatever the implementation
recomputes or skips). PaLM (Chowdhery et al., 2022, appendix B) counts 6N + 12LHQT
matmul FLOPs per token trained (N params, L layers, H heads, Q head dim, T the sequence
length): 2 FLOPs per multiply-add of every weight and of every query-key pair (scores
q.k and the weighted sum p.v, 2 x 2 H Q per pair and layer), the backward pass twice the
forward. Chinchilla (Hoffmann et al., 2022, appendix F) counts the same matmuls term by
term (plus the softmax, which this leaves out as PaLM does). Here one forward pass over
`tokens` tokens, `logit_tokens` of them projected to the vocabulary, and `pairs`
query-key pairs costs

    forward = 2 * L * W * tokens + 2 * D * V * logit_tokens + 4 * L * N * H * pairs,
    W = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F   (q, k, v, o; gate, up, down)

(D model width, N query heads, K kv heads, H head dim, F MLP width, V vocabulary). The
input embedding is a gather (no FLOPs); norms, biases, RoPE and the softmax are not
matmuls. As in PaLM every token attends every key of its sequence (no causal halving:
the convention behind published MFUs, so numbers compare), so a sequence of n tokens has
n^2 pairs. A forward + backward is 3 x forward (PaLM's 6N = 3 x 2N); remat's recomputed
forward is not counted (that would be hardware FLOPs, not model FLOPs).

A GRPO step (`step_flops`), from the arrays the trainer holds:
  - the update, `epochs` x 3 x forward over the prompt-sharing batch: each distinct prompt
    once (its p valid tokens, p^2 pairs), each response's r valid tokens attending its
    prompt and itself (r (p + r) pairs), logits for the response tokens (`update_counts`;
    a prompt split over micro-batches or devices runs more than once: not counted);
  - each extra forward over the same batch: reference log-probs (KL), old-policy
    log-probs (`rl.recompute_old_logp`);
  - the rollout, one forward over every trajectory's n = prompt + response tokens (each
    prefilled or decoded once: the cache is kept across tool calls), n^2 pairs, logits
    for the sampled tokens (`rollout_counts`).

MFU (PaLM's definition) = model FLOPs per second per device / the chip's peak
(`CHIPS`: dense bf16 FLOP/s, from the vendors' spec pages). A device kind not in the
table (a CPU) has no peak: MFU is NaN. The table also holds each chip's HBM bandwidth, the
bound of a decode step (which reads every weight and the KV cache once per token), for
the fraction of it a decode loop reaches (benchmarks/gpu_check.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from car_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # dense (no sparsity) bf16 matmul FLOP/s of one chip
    hbm_bytes: float  # memory of one chip
    hbm_bytes_per_s: float  # peak HBM bandwidth of one chip (the vendor's figure)


# `jax.devices()[0].device_kind` -> the chip; a kind is matched by the first entry whose
# key it contains (lowercased), so the more specific keys come first.
CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s per chip; kind "TPU v5 lite"
    "tpu v5 lite": Chip("v5e", 197e12, 16 * 2**30, 819e9),
    "tpu v5e": Chip("v5e", 197e12, 16 * 2**30, 819e9),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s per chip; kind "TPU v5p" (or "TPU v5")
    "tpu v5": Chip("v5p", 459e12, 95 * 2**30, 2765e9),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB HBM at 1,640 GB/s per chip; kind "TPU v6 lite"
    "tpu v6": Chip("v6e", 918e12, 32 * 2**30, 1640e9),
    # nvidia.com/en-us/data-center/h100 (datasheet): H100 SXM 989 TFLOP/s bf16 dense (1,979
    # with sparsity), 80 GB at 3.35 TB/s; H100 PCIe 756 TFLOP/s dense, 80 GB at 2.0 TB/s
    "h100 pcie": Chip("h100-pcie", 756e12, 80e9, 2.0e12),
    "h100 nvl": Chip("h100-nvl", 835e12, 94e9, 3.9e12),  # the same datasheet: 835 TFLOP/s dense, 94 GB, 3.9 TB/s
    "h100": Chip("h100", 989e12, 80e9, 3.35e12),
    # nvidia.com/en-us/data-center/h200 (datasheet): H200 SXM 989 TFLOP/s bf16 dense (1,979
    # with sparsity), 141 GB at 4.8 TB/s; H200 NVL 835 TFLOP/s dense, 4.8 TB/s
    "h200 nvl": Chip("h200-nvl", 835e12, 141e9, 4.8e12),
    "h200": Chip("h200", 989e12, 141e9, 4.8e12),
}


def chip(device_kind: str) -> Chip | None:
    """The chip of a device kind ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), None if unknown ("cpu")."""
    kind = device_kind.lower()
    return next((c for key, c in CHIPS.items() if key in kind), None)


def layer_matmul_params(cfg: ModelConfig) -> int:
    """W: the weights one layer multiplies each token by (q, k, v, o; gate, up, down)."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
    return d * n * h + 2 * d * k * h + n * h * d + 3 * d * f


def forward_flops(cfg: ModelConfig, tokens: float, logit_tokens: float, pairs: float) -> float:
    """One forward pass (the module docstring's formula)."""
    c = cfg
    return (2.0 * c.n_layers * layer_matmul_params(c) * tokens + 2.0 * c.d_model * c.vocab_size * logit_tokens
            + 4.0 * c.n_layers * c.n_heads * c.head_dim * pairs)


def update_counts(prompts_valid: np.ndarray, prompt_of: np.ndarray, valid: np.ndarray) -> tuple[int, int, int]:
    """(tokens, logit_tokens, pairs) of the prompt-sharing forward: prompts_valid bool[U, P],
    prompt_of int32[B] (each row's prompt), valid bool[B, R] (a HostBatch's arrays)."""
    p = np.asarray(prompts_valid).sum(axis=1).astype(np.int64)  # [U]
    r = np.asarray(valid).sum(axis=1).astype(np.int64)  # [B]
    return int(p.sum() + r.sum()), int(r.sum()), int((p * p).sum() + (r * (p[np.asarray(prompt_of)] + r)).sum())


def rollout_counts(prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                   sampled: Sequence[int]) -> tuple[int, int, int]:
    """(tokens, logit_tokens, pairs) of the rollout: per trajectory its prompt and response
    lengths (sampled and observation tokens) and its sampled tokens."""
    n = np.asarray(prompt_lengths, np.int64) + np.asarray(response_lengths, np.int64)
    return int(n.sum()), int(np.sum(sampled)), int((n * n).sum())


def step_flops(cfg: ModelConfig, update: tuple[int, int, int], rollout: tuple[int, int, int],
               epochs: int, logprob_passes: int) -> float:
    """Model FLOPs of a GRPO step: `epochs` forward + backward passes and `logprob_passes`
    forward passes over the update's counts, one forward over the rollout's."""
    return (3 * epochs + logprob_passes) * forward_flops(cfg, *update) + forward_flops(cfg, *rollout)


def perf_metrics(flops: float, seconds: float, devices: int, device_kind: str) -> dict[str, float]:
    """{"perf/model_tflops_per_device": flops / seconds / devices in TFLOP/s, "perf/mfu": that
    over the chip's peak (NaN where the device kind has none in `CHIPS`)}."""
    per_device = flops / max(seconds, 1e-9) / max(devices, 1)
    c = chip(device_kind)
    return {"perf/model_tflops_per_device": per_device / 1e12,
            "perf/mfu": per_device / c.peak_bf16_flops if c else float("nan")}


def chip_named(name: str) -> Chip:
    """The chip called `name` in `CHIPS` ("v5e", "v5p", "v6e", "h100", "h200", ...); a
    ValueError listing the names otherwise."""
    by_name = {c.name: c for c in CHIPS.values()}
    if name.lower() not in by_name:
        raise ValueError(f"unknown chip {name!r}; use one of {', '.join(sorted(by_name))}")
    return by_name[name.lower()]
