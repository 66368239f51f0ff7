"""Attention over [T, S] for training and prefill, and the variants the policy picks from.

`dense_attention` is the plain one: float32 scores [B, K, G, T, S] and their softmax in one
piece (autodiff keeps the probabilities for the backward pass). `blockwise_attention` never
holds them: FlashAttention-2 (Dao, 2023, algorithms 1 and 2) in plain JAX. Queries go in
blocks of bq, keys in blocks of bk; the forward keeps a running max, sum and output per
query row (online softmax) and saves only the output and each row's logsumexp; the
backward (`jax.custom_vjp`) recomputes each block's scores from them, one pass over key
blocks that accumulates dk, dv per key block and dq into one [T]-long buffer. At any time
one block's float32 scores [B, K, bq, G, bk] exist: memory grows linearly in T, not as
T * S (BENCHMARKS.md, "Training attention memory").

The mask. Every mask the model builds is a slot mask (`slot_mask`): query t sits at slot
offset + t and sees key slot s iff `key_ok[s] and s <= offset + t`, or `s == offset + t`
(valid earlier keys, and always itself). The decoder's causal mask is one with offset 0;
a cached chunk's, with offset the cache index; a response after its shared prompt
(`models.prompt_forward`), with the prompt's P slots first and offset P. A dense mask
bool[B, T, S] of that form gives key_ok back as its last row: up to the last query's own
slot that row is key_ok, that slot is seen by the last query alone (which sees it anyway),
and no query sees a later one. Key blocks wholly after a query block's last slot are
skipped (for a causal mask, about half of the work).

The variants (`ExecutionPolicy.attention`) are small frozen objects: `handles(t, s)` says
from the static shape whether the variant runs (where it says no, the layer runs its
plain attention: `dense_attention`, or for a cached chunk its matmuls over the cache), and
`variant(q, k, v, mask, offset)` computes it. `DENSE` handles nothing; `Blockwise` handles
chunks of more than one query with at least `min_scores` scores per head (never a decode
step); `Fused` calls `jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU).

Letters (`car_jax.dims`): B rows, T queries, S keys (cache slots), K kv heads, G query
heads per kv head, H head dim; the blocked arrays carry a leading block axis (nq query
blocks of bq rows, nk key blocks of bk slots).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from car_jax.models.fused import softmax

NEG = float(jnp.finfo(jnp.float32).min)  # the score of a masked key
F32 = jnp.float32


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, K, G, H] (already scaled by H^-1/2), k / v [B, S, K, H], mask bool[B, T, S]
    -> [B, T, K, G, H] in v's dtype: softmax of the float32 scores, cast to v's dtype, times v."""
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=F32)
    probs = softmax(jnp.where(mask[:, None, None], scores, NEG)).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)


def slot_mask(key_ok: jax.Array, offset, t: int) -> jax.Array:
    """key_ok bool[B, S], offset int32[] (query t at slot offset + t) -> bool[B, T, S]: each
    query sees the valid keys at or before its slot, and always its own slot."""
    slot = jnp.arange(key_ok.shape[1])[None, :]
    q_slot = offset + jnp.arange(t)[:, None]
    return (key_ok[:, None, :] & (slot <= q_slot)[None]) | (slot == q_slot)[None]


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array, offset,
                        block_q: int = 512, block_k: int = 512) -> jax.Array:
    """`dense_attention(q, k, v, slot_mask(key_ok, offset, T))` without the [T, S] scores.
    q [B, T, K, G, H] (already scaled), k / v [B, S, K, H], key_ok bool[B, S], offset
    int32[] -> [B, T, K, G, H] in q's dtype. T and S are padded up to whole blocks (padded
    keys are never seen, padded queries are dropped)."""
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    qb = _pad(q, nq * bq).reshape(b, nq, bq, kh, g, h).transpose(1, 0, 3, 2, 4, 5)  # [nq, B, K, bq, G, H]
    kb, vb = (_pad(a, nk * bk).reshape(b, nk, bk, kh, h).transpose(1, 0, 3, 2, 4) for a in (k, v))  # [nk, B, K, bk, H]
    okb = _pad(key_ok, nk * bk).reshape(b, nk, bk).swapaxes(0, 1)  # [nk, B, bk]
    out = _flash(qb, kb, vb, okb, jnp.asarray(offset, jnp.int32), s)  # [nq, B, K, bq, G, H]
    return out.transpose(1, 0, 3, 2, 4, 5).reshape(b, nq * bq, kh, g, h)[:, :t]


def _pad(a: jax.Array, n: int) -> jax.Array:
    """a [B, X, ...] padded with zeros (False) along axis 1 to n."""
    return jnp.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


def _visible(i, j, ok: jax.Array, offset, bq: int, bk: int, n_keys: int) -> jax.Array:
    """bool[B, 1, bq, 1, bk]: which keys of key block j (ok bool[B, bk]) the queries of query
    block i see (`slot_mask`); keys padded past n_keys are never seen."""
    q_slot = offset + i * bq + jnp.arange(bq)[:, None]  # [bq, 1]
    k_slot = j * bk + jnp.arange(bk)[None, :]  # [1, bk]
    vis = (ok[:, None, :] & (k_slot <= q_slot)[None]) | (k_slot == q_slot)[None]
    return (vis & (k_slot < n_keys)[None])[:, None, :, None, :]


def _scores(qi: jax.Array, kj: jax.Array) -> jax.Array:
    """qi [B, K, bq, G, H], kj [B, K, bk, H] -> float32 [B, K, bq, G, bk]."""
    return jnp.einsum("BKTGH,BKSH->BKTGS", qi, kj, preferred_element_type=F32)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(qb, kb, vb, okb, offset, n_keys):
    """Blocked q [nq, B, K, bq, G, H], k / v [nk, B, K, bk, H], key_ok [nk, B, bk] -> the
    output [nq, B, K, bq, G, H]."""
    return _flash_fwd(qb, kb, vb, okb, offset, n_keys)[0]


def _flash_fwd(qb, kb, vb, okb, offset, n_keys):
    nq, b, kh, bq, g, h = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]

    def query_block(_, xs):
        i, qi = xs
        last = offset + (i + 1) * bq - 1  # the block's last query slot: later key blocks are unseen

        def key_block(j, carry):
            m, l, acc = carry  # running max, sum [B, K, bq, G] and output [B, K, bq, G, H]
            vis = _visible(i, j, okb[j], offset, bq, bk, n_keys)
            sc = jnp.where(vis, _scores(qi, kb[j]), NEG)
            m_new = jnp.maximum(m, sc.max(axis=-1))
            p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("BKTGS,BKSH->BKTGH", p.astype(vb.dtype), vb[j], preferred_element_type=F32)
            return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

        init = (jnp.full((b, kh, bq, g), NEG, F32), jnp.zeros((b, kh, bq, g), F32),
                jnp.zeros((b, kh, bq, g, h), F32))
        m, l, acc = jax.lax.fori_loop(0, jnp.clip(last // bk + 1, 0, nk), key_block, init)
        l = jnp.where(l > 0, l, 1.0)  # a row that sees no key (only a padded query): output 0
        return None, ((acc / l[..., None]).astype(qb.dtype), m + jnp.log(l))

    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(nq), qb))
    return out, (qb, kb, vb, okb, offset, out, lse)


def _flash_bwd(n_keys, res, dout):
    qb, kb, vb, okb, offset, out, lse = res  # lse [nq, B, K, bq, G]
    nq, bq = qb.shape[0], qb.shape[3]
    b, kh, bk, h = kb.shape[1:]
    dt = qb.dtype
    dout = dout.astype(dt)
    delta = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1)  # rowsum(dP * P) = rowsum(dO * O)

    def key_block(dq, xs):
        j, kj, vj, okj = xs

        def query_block(i, carry):
            dk, dv, dq = carry
            qi, doi = qb[i], dout[i]
            vis = _visible(i, j, okj, offset, bq, bk, n_keys)
            p = jnp.where(vis, jnp.exp(_scores(qi, kj) - lse[i][..., None]), 0.0)  # [B, K, bq, G, bk]
            dv = dv + jnp.einsum("BKTGS,BKTGH->BKSH", p.astype(dt), doi, preferred_element_type=F32)
            dp = jnp.einsum("BKTGH,BKSH->BKTGS", doi, vj, preferred_element_type=F32)
            ds = (p * (dp - delta[i][..., None])).astype(dt)
            dk = dk + jnp.einsum("BKTGS,BKTGH->BKSH", ds, qi, preferred_element_type=F32)
            dq = dq.at[i].add(jnp.einsum("BKTGS,BKSH->BKTGH", ds, kj, preferred_element_type=F32))
            return dk, dv, dq

        first = jnp.clip((j * bk - offset) // bq, 0, nq)  # earlier query blocks never see block j
        zeros = jnp.zeros((b, kh, bk, h), F32)
        dk, dv, dq = jax.lax.fori_loop(first, nq, query_block, (zeros, zeros, dq))
        return dq, (dk.astype(kb.dtype), dv.astype(vb.dtype))

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, F32), (jnp.arange(kb.shape[0]), kb, vb, okb))
    return dq.astype(dt), dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@dataclasses.dataclass(frozen=True)
class Dense:
    """The layer's own plain attention everywhere."""

    def handles(self, t: int, s: int) -> bool:
        return False

    def __call__(self, q, k, v, mask, offset):
        return dense_attention(q, k, v, mask)


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """`blockwise_attention` for chunks of T > 1 queries over S keys with T * S >=
    min_scores (scores per head and row); decode steps never."""
    block_q: int = 512
    block_k: int = 512
    min_scores: int = 0

    def handles(self, t: int, s: int) -> bool:
        return t > 1 and t * s >= self.min_scores

    def __call__(self, q, k, v, mask, offset):
        """q [B, T, K, G, H] (scaled), k / v [B, S, K, H], a slot mask bool[B, T, S] (see
        above: only its last row is read), offset int32[] -> [B, T, K, G, H]."""
        return blockwise_attention(q, k, v, mask[:, -1, :], offset, self.block_q, self.block_k)


@dataclasses.dataclass(frozen=True)
class Fused:
    """`jax.nn.dot_product_attention` with `implementation` ("cudnn": cuDNN's fused flash
    kernel, GPU only, bf16 / fp16 only; "xla": XLA's dense one, which tests the wiring on
    a CPU). Its own padding and causal masks assume right padding and queries aligned at
    slot 0; the model's masks (left-padded prompts, holes in a cache, a chunk at a cache
    offset) need the general boolean mask, which the cuDNN path adds to the scores as a
    [B, 1, T, S] bias: no per-head float32 scores are held, but that bias is still T * S.
    Not run on a GPU yet, so no policy picks it by default (`policy.CUDNN_ATTENTION`)."""
    implementation: str = "cudnn"
    min_scores: int = 0

    def handles(self, t: int, s: int) -> bool:
        return t > 1 and t * s >= self.min_scores

    def __call__(self, q, k, v, mask, offset):
        b, t, kh, g, h = q.shape  # head n = k * G + g, as jax.nn groups them
        out = jax.nn.dot_product_attention(q.reshape(b, t, kh * g, h), k.astype(q.dtype), v.astype(q.dtype),
                                           mask=mask[:, None], scale=1.0, implementation=self.implementation)
        return out.reshape(q.shape)


DENSE = Dense()
