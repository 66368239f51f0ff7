"""Ops with their own VJPs that keep fewer activations for the backward pass.

In a layer `scan`, each activation autodiff keeps is stacked over the L layers into a
fresh buffer, so activations kept cost memory traffic as well as memory.

`swiglu`: the MLP product `(silu(x @ wg) * (x @ wu)) @ wd`. Autodiff of the plain
expression keeps four [X, F] activations per layer for the backward pass (gate, up,
silu(gate) and their product, the down projection's input), and a compiler may add
layout copies of some. This op keeps the two pre-activations only and recomputes the
elementwise product in the backward pass (a few elementwise ops on [X, F], against the
three matmuls of that pass): half the MLP's residual memory. Matmuls run like
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
           transpose: Callable = jnp.transpose) -> jax.Array:
    """x [X, D], wg / wu [D, F], wd [F, D], all in one dtype -> [X, D] in that dtype.
    `transpose` turns a 2D operand of the backward products into its transpose."""
    return _swiglu(transpose, x, wg, wu, wd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu(transpose, x, wg, wu, wd):
    return _swiglu_fwd(transpose, x, wg, wu, wd)[0]


def _swiglu_fwd(transpose, x, wg, wu, wd):
    gate, up = dot32(x, wg).astype(x.dtype), dot32(x, wu).astype(x.dtype)  # [X, F]
    y = dot32(jax.nn.silu(gate) * up, wd).astype(x.dtype)
    return y, (x, gate, up, wg, wu, wd)


def _swiglu_bwd(transpose, res, dy):
    x, gate, up, wg, wu, wd = res
    dt = x.dtype
    dy = dy.astype(dt)
    g32 = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    silu = g32 * sig
    act = (silu * up.astype(jnp.float32)).astype(dt)  # the down projection's input, again
    d_act = dot32(dy, transpose(wd))  # [X, F] float32
    d_up = (d_act * silu).astype(dt)
    d_gate = (d_act * up.astype(jnp.float32) * sig * (1.0 + g32 * (1.0 - sig))).astype(dt)
    dx = (dot32(d_gate, transpose(wg)) + dot32(d_up, transpose(wu))).astype(dt)
    xt = transpose(x)
    return (dx, dot32(xt, d_gate).astype(wg.dtype), dot32(xt, d_up).astype(wu.dtype),
            dot32(transpose(act), dy).astype(wd.dtype))


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
