"""The GRPO loss fused into the vocabulary projection: one projection per position.

The loss is a weighted sum of per-token terms (`grpo.token_loss` x `grpo.token_weights`),
so its gradient w.r.t. a position's logits is known as soon as those logits are. The
forward pass here runs, chunk by chunk (`logprobs.to_chunks`): the logits, the log-prob
and entropy of the target, the per-token loss and its gradient, and from that the
gradients w.r.t. the hidden states and the unembedding. The backward pass only scales
them by the loss's cotangent. Autodiff through `logprobs.chunked_head` instead projects
every position twice (forward, then again in the backward pass to get the softmax back;
with a single chunk XLA merges the two itself). Both hold one chunk's logits [B*C, V]
at a time.

The log-probs and entropies come out under `stop_gradient` (for metrics): the gradient
flows through the loss only. With a frozen unembedding (LoRA: `HeadSpec.head_grad` off) no
gradient w.r.t. it is summed: its [D, V] accumulator and the chunks' matmuls into it are
left out (XLA cannot drop a loop-carried sum the caller never reads).

Letters (`car_jax.dims`): B rows, R positions (response tokens), X flattened rows of a
chunk (B * C), C positions per chunk, D model width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from car_jax.models.policy import PLAIN, ExecutionPolicy
from car_jax.rl import grpo
from car_jax.rl.logprobs import ChunkSoftmax, chunked_head, from_chunks, head_grads, softmax_stats, to_chunks


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """How the head runs, fixed when the step is traced (hashable): `chunk`, the most
    positions C of a chunk (`logprobs.to_chunks`); `policy`, the model's execution policy
    (how the sums over V and the backward transposes are computed); `temperature`, the
    rollout's log-prob temperature (the logits are divided by it, as the sampler's were);
    `head_grad`, whether the unembedding is trained (False: its gradient comes back as zeros,
    never computed)."""
    chunk: int = 128
    policy: ExecutionPolicy = PLAIN
    temperature: float = 1.0
    head_grad: bool = True


def _chunk_grads(h, w, y, ctx, inv_t: float, cfg: grpo.LossConfig, policy: ExecutionPolicy):
    """One chunk: h [X, D], w [D, V], y int32[X], ctx (old_logp, ref_logp, advantage,
    weight, TIS weight) float32[X] each -> (loss [], logp [X], entropy [X], dh [X, D],
    dw float32[D, V])."""
    old, ref, adv, weight, tis = ctx
    logp, entropy, lse, x = softmax_stats(h, w, y, inv_t, keep=True, policy=policy)
    loss_of = lambda lp, ent: (weight * grpo.token_loss(lp, ent, old, ref, adv, cfg, tis)).sum()  # noqa: E731
    loss, (g_lp, g_ent) = jax.value_and_grad(loss_of, argnums=(0, 1))(logp, entropy)
    # p = exp(x - lse) is exponentiated again inside rather than kept from the forward:
    # one [X, V] buffer less to read
    dh, dw = head_grads(h, w, y, ChunkSoftmax(x, lse, entropy), g_lp, g_ent, inv_t, policy)
    return loss, logp, entropy, dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(h, w, y, ctx, inv_t, cfg, chunk, policy, head_grad):
    return _fused_fwd(h, w, y, ctx, inv_t, cfg, chunk, policy, head_grad)[0]


def _fused_fwd(h, w, y, ctx, inv_t, cfg, chunk, policy, head_grad):
    b, n, d = h.shape

    def one_chunk(dw, xs):
        hc, yc, *cc = xs
        loss, logp, entropy, dh, dwc = _chunk_grads(hc, w, yc, cc, inv_t, cfg, policy)
        return (dw + dwc if head_grad else dw), (loss, logp, entropy, dh)  # frozen: dwc is dead code

    dw0 = jnp.zeros((d, w.shape[1]), jnp.float32) if head_grad else None
    xs = (to_chunks(h, chunk), to_chunks(y, chunk), *(to_chunks(c, chunk) for c in ctx))
    dw, (loss, logp, entropy, dh) = jax.lax.scan(one_chunk, dw0, xs)
    out = (loss.sum(), from_chunks(logp, b, n), from_chunks(entropy, b, n))
    return out, (from_chunks(dh, b, n), None if dw is None else dw.astype(w.dtype), w)


def _fused_bwd(inv_t, cfg, chunk, policy, head_grad, res, ct):
    dh, dw, w = res
    g = ct[0]  # the loss's cotangent; logp and entropy leave under stop_gradient
    dw = jnp.zeros_like(w) if dw is None else (g * dw).astype(dw.dtype)
    return (g * dh).astype(dh.dtype), dw, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def grpo_head_loss(h: jax.Array, w: jax.Array, tokens: jax.Array, targets: grpo.LossTargets, cfg: grpo.LossConfig,
                   norm: grpo.Norm, head: HeadSpec = HeadSpec()) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, R, D] hidden states predicting tokens int32[B, R], w [D, V] the unembedding;
    `targets` the batch's side of the loss (old_logp / ref_logp / mask / sampler_logp
    float32[B, R], advantages float32[B]; sampler_logp needed with cfg.tis_cap). Returns
    (loss, logp, entropy): the loss equals `grpo.grpo_loss` of the log-probs and entropies
    of softmax(h @ w / head.temperature) (same targets, Norm and TIS weights; its gradient
    w.r.t. h and w is exact), and logp / entropy float32[B, R] come out without a
    gradient. The positions run in chunks of at most head.chunk under head.policy. With
    cfg.ratio="sequence" (GSPO) one more projection pass, without a gradient, gives the
    sequence ratios first (`grpo.sequence_old_logp`)."""
    old_logp = targets.old_logp
    adv = jnp.broadcast_to(targets.advantages[:, None].astype(jnp.float32), tokens.shape)
    ref = jnp.zeros_like(old_logp) if targets.ref_logp is None else targets.ref_logp
    tis = grpo.tis_weights(old_logp, targets.sampler_logp, cfg)
    tis = jnp.ones_like(old_logp) if tis is None else tis  # off: times 1, exactly the plain surrogate
    if cfg.ratio == "sequence":  # GSPO: the sequence ratio needs every position's log-prob first
        now = chunked_head(h, tokens, w, 1.0 / head.temperature, head.chunk, head.policy)[0]
        old_logp = grpo.sequence_old_logp(now, old_logp, targets.mask)
    ctx = (old_logp, ref, adv, grpo.token_weights(targets.mask, cfg.agg, norm), tis)
    loss, logp, entropy = _fused(h, w, tokens, ctx, 1.0 / head.temperature, cfg, head.chunk, head.policy,
                                 head.head_grad)
    return loss, jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy)
