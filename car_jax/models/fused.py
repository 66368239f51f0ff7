"""Ops with their own VJPs that keep fewer activations for the backward pass.

In a layer `scan`, each activation autodiff keeps is stacked over the L layers into a
fresh buffer, so activations kept cost memory traffic as well as memory.

`swiglu`: the MLP product `(silu(x @ wg) * (x @ wu)) @ wd`. Autodiff of the plain
expression keeps four [X, F] activations per layer for the backward pass (gate, up,
silu(gate) and their product, the down projection's input), and a compiler may add
layout copies of some. This op keeps the two pre-activations only and recomputes the
elementwise product in the backward pass (a few elementwise ops on [X, F], against the
three matmuls of that pass): half the MLP's residual memory. With LoRA adapters on its
projections (`adapters`) each adds its low-rank term, forward and backward, in the same op. Matmuls run like
`layers._matmul`: operands in the compute dtype, float32 accumulation (`dot32`),
backward operands through the execution policy's `transpose` (plain: `jnp.transpose`).

`softmax`: autodiff of `jax.nn.softmax` keeps both exp(x - max) and the probabilities;
this one keeps the probabilities only (dx = y * (dy - sum(y * dy))).

Letters (`car_jax.dims`): X flattened token rows, D model width, F MLP width.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp


def dot32(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with float32 accumulation and a float32 result."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def swiglu(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array,
           transpose: Callable = jnp.transpose, adapters: tuple | None = None, scale: float = 0.0) -> jax.Array:
    """x [X, D], wg / wu [D, F], wd [F, D], all in one dtype -> [X, D] in that dtype.
    `transpose` turns a 2D operand of the backward products into its transpose.
    `adapters`: None, or LoRA factors per projection (gate, up, down), each None or a pair
    (A [in, r], B [r, out]) in that dtype: the projection of z then is z W + scale (z A) B,
    and the op keeps the [X, r] products scale (z A) of gate and up besides its two
    pre-activations (the down projection's is recomputed with its input)."""
    return _swiglu(transpose, scale, x, wg, wu, wd, tuple(adapters or (None, None, None)))


def _project(z, w, ab, scale):
    """(z W + scale (z A) B float32 [X, out], scale (z A) [X, r] in z's dtype) of z [X, in]
    for ab = (A, B); (z W, None) when ab is None."""
    if ab is None:
        return dot32(z, w), None
    zs = (dot32(z, ab[0]) * scale).astype(z.dtype)
    return dot32(z, w) + dot32(zs, ab[1]), zs


def _low_rank_bwd(transpose, z, zs, ab, d, scale):
    """Back through scale (z A) B given its cotangent d [X, out] (z's dtype), zs = scale (z A):
    (dz float32 [X, in], (dA, dB))."""
    a, b = ab
    dzs = dot32(d, transpose(b)).astype(z.dtype)  # [X, r]
    return scale * dot32(dzs, transpose(a)), ((scale * dot32(transpose(z), dzs)).astype(a.dtype),
                                              dot32(transpose(zs), d).astype(b.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _swiglu(transpose, scale, x, wg, wu, wd, adapters):
    return _swiglu_fwd(transpose, scale, x, wg, wu, wd, adapters)[0]


def _swiglu_fwd(transpose, scale, x, wg, wu, wd, adapters):
    (ag, au, ad), dt = adapters, x.dtype
    gate, xs_g = _project(x, wg, ag, scale)
    up, xs_u = _project(x, wu, au, scale)
    gate, up = gate.astype(dt), up.astype(dt)  # [X, F]
    y = _project(jax.nn.silu(gate) * up, wd, ad, scale)[0].astype(dt)
    return y, (x, gate, up, wg, wu, wd, adapters, xs_g, xs_u)


def _swiglu_bwd(transpose, scale, res, dy):
    x, gate, up, wg, wu, wd, (ag, au, ad), xs_g, xs_u = res
    dt = x.dtype
    dy = dy.astype(dt)
    g32 = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    silu = g32 * sig
    act = (silu * up.astype(jnp.float32)).astype(dt)  # the down projection's input, again
    d_act = dot32(dy, transpose(wd))  # [X, F] float32
    d_ad = None
    if ad is not None:
        xs_d = (dot32(act, ad[0]) * scale).astype(dt)
        d_low, d_ad = _low_rank_bwd(transpose, act, xs_d, ad, dy, scale)
        d_act = d_act + d_low
    d_up = (d_act * silu).astype(dt)
    d_gate = (d_act * up.astype(jnp.float32) * sig * (1.0 + g32 * (1.0 - sig))).astype(dt)
    dx = dot32(d_gate, transpose(wg)) + dot32(d_up, transpose(wu))
    d_ag = d_au = None
    if ag is not None:
        d_low, d_ag = _low_rank_bwd(transpose, x, xs_g, ag, d_gate, scale)
        dx = dx + d_low
    if au is not None:
        d_low, d_au = _low_rank_bwd(transpose, x, xs_u, au, d_up, scale)
        dx = dx + d_low
    xt = transpose(x)
    return (dx.astype(dt), dot32(xt, d_gate).astype(wg.dtype), dot32(xt, d_up).astype(wu.dtype),
            dot32(transpose(act), dy).astype(wd.dtype), (d_ag, d_au, d_ad))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def softmax(x: jax.Array) -> jax.Array:
    """softmax over the last axis of float32 x (-inf / finfo.min entries give 0)."""
    return _softmax_fwd(x)[0]


def _softmax_fwd(x):
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True)))
    y = e / e.sum(axis=-1, keepdims=True)
    return y, y


def _softmax_bwd(y, dy):
    return (y * (dy - (y * dy).sum(axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)
