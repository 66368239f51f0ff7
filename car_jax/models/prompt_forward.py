"""The training forward over prompt + response, each distinct prompt computed once.

A GRPO batch holds G responses per prompt. The plain forward over full sequences runs
every row's copy of the prompt through every layer again; here the distinct prompts
[U, P] run once, and each response row [B, R] attends to its prompt's keys and values
(gathered by `prompt_index`) and then causally to itself, as a decode step attends to
a KV cache. Autodiff sums the gradients of a shared prompt over the rows that read it,
so the hidden states, the loss and its gradient equal the plain forward's (up to float
rounding). Only response positions come out: no vocabulary projection is ever spent on
a prompt token.

On a mesh the residual streams of the prompts and the responses are held in the sharding
table's "hidden" layout (rows over fsdp, D whole; `sharding.rows_constraint`) on the mesh
the caller traces with in context (`jax.sharding.use_abstract_mesh`, as the jitted steps of
`rl.steps` do) or, failing that, the mesh the embedding table is laid out on: without it,
XLA follows the embedding table's layout (D over fsdp) and every device runs the matmuls
of all the micro-batch's rows.

Letters (`car_jax.dims`): U prompts, P prompt length, B rows, R response length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from car_jax.models.cache import LayerKV
from car_jax.models.decoder import Decoder
from car_jax.models.flash import slot_mask
from car_jax.models.layers import rms_norm
from car_jax.sharding import rows_constraint


def prompt_response_hidden(module: Decoder, params, prompt: jax.Array, prompt_valid: jax.Array,
                           tokens: jax.Array, valid: jax.Array, prompt_index: jax.Array | None = None):
    """prompt int32[U, P], left-padded (prompt_valid bool[U, P]); tokens int32[B, R], the
    responses, right-padded (valid bool[B, R]); row b continues prompt prompt_index[b]
    (int32[B]; None: U == B and row b continues prompt b, no gather at all).

    Returns (last [B, D], hidden [B, R, D]), final-normed in the compute dtype: the hidden
    state at each row's last prompt token (it predicts the first response token) and at
    each response token. The layers run as `module.policy.layers.over_layers` says (the
    plain policy: a `lax.scan` over the stacked layers), attention as
    `module.policy.attention` says (long prompts and responses: blockwise, `models.flash`);
    `module.remat` recomputes each layer in the backward pass."""
    c, dt = module.cfg, module.dtype
    u, p_len = prompt.shape
    b, r = tokens.shape
    if prompt_index is None and u != b:
        raise ValueError(f"{u} prompts for {b} rows: pass prompt_index (which prompt each row continues)")
    take = (lambda a: a) if prompt_index is None else (lambda a: a[prompt_index])  # [U, ...] -> [B, ...]
    prompt_valid, valid = prompt_valid.astype(bool), valid.astype(bool)
    embed = params["embed"].astype(dt)
    xp, xr = rows_constraint(embed[prompt], embed), rows_constraint(embed[tokens], embed)  # [U, P, D], [B, R, D]
    # RoPE positions count valid tokens only; a response continues after its prompt's
    pos_p = jnp.maximum(jnp.cumsum(prompt_valid, axis=1) - 1, 0)
    pos_r = take(prompt_valid.sum(axis=1))[:, None] + jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    mask_p = slot_mask(prompt_valid, 0, p_len)  # [U, P, P]: causal over valid keys
    # [B, R, P + R]: the prompt's valid keys, then causal over the response's own
    mask_r = slot_mask(jnp.concatenate([take(prompt_valid), valid], axis=1), p_len, r)
    block = module.block().clone(attention=module.policy.attention)
    k_heads, h = c.n_kv_heads, c.head_dim
    cd = module.policy.cache_dtype(dt)
    empty = LayerKV(jnp.zeros((u, k_heads, h, p_len), cd), jnp.zeros((u, k_heads, p_len, h), cd))

    def layer(p, carry):
        # the prompts write their keys / values into an empty cache of P slots; each row
        # reads its prompt's, with R more slots where it writes its own
        xp, xr = carry
        yp, kv = block.apply({"params": p}, xp, pos_p, mask_p, empty, 0)
        kv = LayerKV(jnp.pad(take(kv.k), ((0, 0), (0, 0), (0, 0), (0, r))),  # [B, K, H, P + R]
                     jnp.pad(take(kv.v), ((0, 0), (0, 0), (0, r), (0, 0))))  # [B, K, P + R, H]
        yr, _ = block.apply({"params": p}, xr, pos_r, mask_r, kv, p_len)
        return rows_constraint(yp, embed), rows_constraint(yr, embed)

    if module.remat:
        layer = jax.checkpoint(layer)
    xp, xr = module.policy.layers.over_layers(layer, (xp, xr), params["layers"])
    last = rms_norm(take(xp[:, -1]), params["final_norm"], c.norm_eps, dt)  # left-padded: slot P-1
    return last, rms_norm(xr, params["final_norm"], c.norm_eps, dt)
