"""Per-token log-probs and entropies without ever holding the full [B, T, V] logits.

The decoder runs once to the final hidden states [B, T, D] (`token_logprobs`, full
sequences) or [B, R, D] (`response_hidden` / `response_logprobs`: responses after shared
prompts, given as one `Prompts`, what the train steps and the reference pass use); the
vocabulary projection, log-softmax, entropy and gather then run over chunks of positions
inside a `lax.scan` (`to_chunks`, `chunked_head`). Each chunk is one custom-gradient op (`head_stats`): its
forward keeps only the chunk's hidden states and two numbers per position, and its
backward recomputes the chunk's logits and writes the gradient in closed form, so both
passes hold one chunk's logits [B, C, V] at a time and pay for two exponentials per
logit in all (autodiff through logsumexp and the entropy takes five). The GRPO train
step skips that recompute: `head_loss` differentiates its loss inside the forward.
The sums over the vocabulary and the transposes of the backward products are the
execution policy's (`policy.row_sum`, `policy.transpose`).
Letters (`car_jax.dims`): X rows (positions of a chunk, flattened), C positions per
chunk, B rows, R response length, U distinct prompts, P prompt length, D model width,
V vocabulary.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from car_jax.models.decoder import Decoder
from car_jax.models.fused import dot32
from car_jax.models.policy import PLAIN, ExecutionPolicy
from car_jax.models.prompt_forward import prompt_response_hidden


class ChunkSoftmax(NamedTuple):
    """What the head's closed-form backward (`head_grads`) reads of one chunk's softmax, as
    `softmax_stats` computed it: the logits x float32[X, V] (already scaled by inv_t), and
    lse and entropy float32[X]."""
    x: jax.Array
    lse: jax.Array
    entropy: jax.Array


class Prompts(NamedTuple):
    """The prompts that responses [B, R] continue, each distinct prompt once
    (`models.prompt_forward`): tokens int32[U, P] left-padded, valid bool[U, P], and index
    int32[B], row b after prompt index[b] (None: row b after prompt b, U == B)."""
    tokens: jax.Array
    valid: jax.Array
    index: jax.Array | None = None


def _logits(h, w, inv_t: float):
    """h [X, D] @ w [D, V] -> float32 [X, V] / temperature."""
    return jnp.dot(h, w, preferred_element_type=jnp.float32) * inv_t


def softmax_stats(h, w, y, inv_t, keep: bool = False, policy: ExecutionPolicy = PLAIN):
    """(logp, entropy, lse) float32[X] of softmax(h @ w * inv_t) at targets y; with
    `keep`, also the logits x [X, V]."""
    x = _logits(h, w, inv_t)  # [X, V]
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    s = policy.row_sum(e)
    lse = m[:, 0] + jnp.log(s)
    logp = jnp.take_along_axis(x, y[:, None], axis=-1)[:, 0] - lse
    entropy = lse - policy.row_sum(e * x) / s
    return (logp, entropy, lse, x) if keep else (logp, entropy, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def head_stats(h: jax.Array, w: jax.Array, y: jax.Array, inv_t: float, policy: ExecutionPolicy = PLAIN):
    """h [X, D] final hidden states, w [D, V] the unembedding, y int32[X] targets ->
    (logp, entropy) float32[X] of softmax(h @ w * inv_t)."""
    logp, entropy, _ = softmax_stats(h, w, y, inv_t, policy=policy)
    return logp, entropy


def _head_fwd(h, w, y, inv_t, policy):
    logp, entropy, lse = softmax_stats(h, w, y, inv_t, policy=policy)
    return (logp, entropy), (h, w, y, lse, entropy)


def head_grads(h, w, y, sm: ChunkSoftmax, g_lp, g_ent, inv_t: float, policy: ExecutionPolicy = PLAIN):
    """Back through the head in closed form: given h [X, D], w [D, V], the targets y
    int32[X], the chunk's softmax `sm` (the logits x [X, V] already scaled by inv_t, lse
    and entropy [X] from `softmax_stats`), and the cotangents g_lp / g_ent [X] of logp_y
    and the entropy, returns (dh [X, D] in h's dtype, dw float32[D, V])."""
    x, lse, entropy = sm
    # d logp_y / dx = onehot(y) - p;  d H / dx = -p (x - lse + H), with p = exp(x - lse)
    p = jnp.exp(x - lse[:, None])
    onehot = jnp.arange(x.shape[-1], dtype=y.dtype)[None, :] == y[:, None]
    d = jnp.where(onehot, g_lp[:, None], 0.0) - p * (g_lp[:, None] + g_ent[:, None] * (x - lse[:, None]
                                                                                     + entropy[:, None]))
    d = (d * inv_t).astype(h.dtype)  # gradient w.r.t. the raw logits [X, V]
    t = policy.transpose
    return dot32(d, t(w)).astype(h.dtype), dot32(t(h), d)


def _head_bwd(inv_t, policy, res, g):
    h, w, y, lse, entropy = res
    dh, dw = head_grads(h, w, y, ChunkSoftmax(_logits(h, w, inv_t), lse, entropy), *g, inv_t, policy)
    return dh, dw.astype(w.dtype), None


head_stats.defvjp(_head_fwd, _head_bwd)


def unembedding(module: Decoder, params) -> jax.Array:
    """The unembedding [D, V] in the compute dtype: the transposed embedding if tied,
    else lm_head."""
    if module.cfg.tie_embeddings:
        return module.policy.transpose(params["embed"].astype(module.dtype))
    return params["lm_head"].astype(module.dtype)


def to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """x [B, R, ...] -> [n_chunks, B * C, ...]: the R positions in ceil(R / chunk) equal
    chunks of C <= chunk each (191 positions are 2 x 96, not 2 x 128), zero-padded."""
    b, n = x.shape[:2]
    n_chunks = -(-n // chunk)
    c = -(-n // n_chunks)
    x = jnp.pad(x, [(0, 0), (0, n_chunks * c - n)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n_chunks, c, *x.shape[2:]).swapaxes(0, 1).reshape(n_chunks, b * c, *x.shape[2:])


def from_chunks(x: jax.Array, b: int, n: int) -> jax.Array:
    """Inverse of `to_chunks`: [n_chunks, B * C, ...] -> [B, R, ...] (R = n)."""
    n_chunks = x.shape[0]
    c = x.shape[1] // b
    return x.reshape(n_chunks, b, c, *x.shape[2:]).swapaxes(0, 1).reshape(b, n_chunks * c, *x.shape[2:])[:, :n]


def chunked_head(h: jax.Array, targets: jax.Array, w: jax.Array, inv_t: float,
                 chunk: int = 128, policy: ExecutionPolicy = PLAIN) -> tuple[jax.Array, jax.Array]:
    """h [B, R, D] hidden states, targets int32[B, R], w [D, V] -> (logp, entropy),
    float32[B, R], of softmax(h @ w * inv_t) at the targets. The R positions run in
    equal chunks of at most `chunk` (`to_chunks`), one `head_stats` per chunk inside a
    `lax.scan`, so only one chunk's logits [B, C, V] exist at a time."""
    b, n, _ = h.shape

    def one_chunk(carry, xs):
        return carry, head_stats(xs[0], w, xs[1], inv_t, policy)

    _, (logp, entropy) = jax.lax.scan(one_chunk, None, (to_chunks(h, chunk), to_chunks(targets, chunk)))
    return from_chunks(logp, b, n), from_chunks(entropy, b, n)


def token_logprobs(module: Decoder, params, tokens: jax.Array, valid: jax.Array | None = None, *,
                   temperature: float = 1.0, chunk: int = 128) -> tuple[jax.Array, jax.Array]:
    """tokens int32[B, T] (right-padded; valid bool[B, T]) -> (logp, entropy), both
    float32[B, T]: logp[b, t] = log softmax(logits / temperature)[tokens[b, t]] predicted
    from position t - 1, and entropy[b, t] the entropy of that distribution; column 0
    (no prediction) is 0. The vocabulary projection runs in chunks (`chunked_head`)."""
    hidden, _ = module.apply({"params": params}, tokens, valid, None, return_hidden=True)  # [B, T, D]
    logp, entropy = chunked_head(hidden[:, :-1], tokens[:, 1:], unembedding(module, params), 1.0 / temperature,
                                 chunk, module.policy)
    zero = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)


def response_hidden(module: Decoder, params, prompts: Prompts, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, R, D] final hidden states that predict each response token: slot r holds the
    state after the prompt and tokens[:, :r] (arguments as `response_logprobs`)."""
    last, hidden = prompt_response_hidden(module, params, prompts.tokens, prompts.valid, tokens, valid,
                                          prompts.index)
    return jnp.concatenate([last[:, None], hidden[:, :-1]], axis=1)


def response_logprobs(module: Decoder, params, prompts: Prompts, tokens: jax.Array, valid: jax.Array, *,
                      temperature: float = 1.0, chunk: int = 128) -> tuple[jax.Array, jax.Array]:
    """Log-probs of responses after prompts, each distinct prompt run once
    (`models.prompt_forward`): `prompts` (`Prompts`: tokens int32[U, P] left-padded, valid
    bool[U, P], index int32[B] or None), tokens int32[B, R] right-padded (valid bool[B, R]),
    row b after prompt prompts.index[b] (None: prompt b). Returns (logp, entropy)
    float32[B, R]: logp[b, r] = log softmax(logits / temperature)[tokens[b, r]] given the
    prompt and tokens[b, :r] (the same numbers as `token_logprobs` of the concatenated sequence, at its response
    positions), and the entropy of that distribution."""
    h = response_hidden(module, params, prompts, tokens, valid)
    return chunked_head(h, tokens, unembedding(module, params), 1.0 / temperature, chunk, module.policy)
