"""Per-token log-probs and entropies without ever holding the full [B, T, V] logits.

The decoder runs once to the final hidden states [B, T, D]; the vocabulary projection,
log-softmax and gather then run over chunks of positions inside a `lax.scan` whose
body is rematerialised, so both the forward and the backward pass hold one chunk's
logits [B, C, V] at a time.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from car_jax.models.decoder import Decoder


def token_logprobs(module: Decoder, params, tokens: jax.Array, valid: jax.Array | None = None, *,
                   temperature: float = 1.0, chunk: int = 128) -> tuple[jax.Array, jax.Array]:
    """tokens int32[B, T] (right-padded; valid bool[B, T]) -> (logp, entropy), both
    float32[B, T]: logp[b, t] = log softmax(logits / temperature)[tokens[b, t]] predicted
    from position t - 1, and entropy[b, t] the entropy of that distribution; column 0
    (no prediction) is 0."""
    hidden, _ = module.apply({"params": params}, tokens, valid, None, return_hidden=True)  # [B, T, D]
    b, t, d = hidden.shape
    h = hidden[:, :-1]  # predicts tokens[:, 1:]
    targets = tokens[:, 1:]
    n = t - 1
    c = min(chunk, n)
    pad = (-n) % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(b, -1, c, d).swapaxes(0, 1)  # [n_chunks, B, C, D]
    targets = targets.reshape(b, -1, c).swapaxes(0, 1)  # [n_chunks, B, C]

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(h_c, y_c):
        logits = module.apply({"params": params}, h_c, method=Decoder.unembed) / temperature  # [B, C, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, y_c[..., None], axis=-1)[..., 0] - lse
        probs = jnp.exp(logits - lse[..., None])
        entropy = lse - (probs * logits).sum(-1)
        return logp, entropy

    _, (logp, entropy) = jax.lax.scan(lambda carry, xs: (carry, one_chunk(*xs)), None, (h, targets))
    logp = logp.swapaxes(0, 1).reshape(b, -1)[:, :n]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)
