"""One decoder layer in Flax (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3): what the Hugging
Face layer computes. GQA attention with RoPE, RMSNorm (pre-norm), SwiGLU MLP, optional
q/k/v (and o, mlp) biases, optional Qwen3 q/k RMSNorm over the head dim.

`dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; norms,
softmax and RoPE run in float32. `transpose` is how the hand-written backward passes
transpose a matmul operand, `attention` which attention runs over a chunk of T tokens and
S keys (`models.flash`: the plain dense one, or a blockwise one for long chunks); both
are the execution policy's (`models.policy`). Every parameter is created from its
declaration in `car_jax.params` (`declared_param`: name, shape, initializer).
Letters: see `car_jax.dims`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from car_jax.models.config import ModelConfig
from car_jax.models.flash import DENSE, NEG, dense_attention
from car_jax.models.fused import dot32, softmax, swiglu
from car_jax.params import INIT_STD, declared

Dtype = Any
LORA_DTYPE = jnp.float32  # adapters are stored in float32 whatever the base's storage dtype


def kaiming_uniform(key, shape, dtype=jnp.float32):
    """A LoRA A [*In, r]: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = prod(In), what PEFT's
    kaiming_uniform_(a=sqrt(5)) draws for its lora_A [r, in]."""
    bound = 1.0 / np.sqrt(np.prod(shape[:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


INITIALIZERS = {"normal": nn.initializers.normal(INIT_STD), "zeros": nn.initializers.zeros,
                "ones": nn.initializers.ones, "lora_a": kaiming_uniform}  # car_jax.params' initializer kinds


def declared_param(module: nn.Module, path: str, dtype: Dtype) -> jax.Array:
    """The param at `path` ("layers/attn/q") as `car_jax.params` declares it, created at init
    (or read) in `module`'s scope under its last name ("q"), with the declared shape for
    `module.cfg` and initializer, stored in `dtype`. An undeclared path, or one the config
    does not have, raises: no param exists that the declaration does not name."""
    p = declared(path)
    if not p.when(module.cfg):
        raise ValueError(f"parameter {path!r} does not apply to this config (car_jax.params)")
    return module.param(p.name, INITIALIZERS[p.init], p.shape(module.cfg), dtype)


def has_adapters(module: nn.Module, path: str) -> bool:
    """Whether the weight at `path` runs with LoRA adapters in `module`: its params hold
    them, or (at init) the config declares them. A tree without them runs the plain weight,
    so the base model is the same module applied to the base params alone."""
    a = declared(path + "_lora_a")
    return module.has_variable("params", a.name) or (module.is_initializing() and a.when(module.cfg))


def lora_factors(module: nn.Module, path: str) -> tuple[jax.Array, jax.Array]:
    """The LoRA factors (A [*In, r], B [r, *Out]) of the weight at `path`, created at init
    (float32, `LORA_DTYPE`) or read. Params holding adapters that the module's config has no
    `lora` for are refused, naming the fix."""
    if module.cfg.lora.rank == 0:
        raise ValueError(f"the params hold LoRA adapters for {path!r} but the model config has lora.rank=0; build "
                         f"the Decoder with the LoraConfig the adapters were made for (ModelConfig.lora)")
    return (declared_param(module, path + "_lora_a", LORA_DTYPE),
            declared_param(module, path + "_lora_b", LORA_DTYPE))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Dtype) -> jax.Array:
    """x [..., D] normalised in float32, then scaled in `dtype` (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * y.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x: jax.Array, w: jax.Array, n_in: int, transpose: Callable) -> jax.Array:
    """x [X, prod(In)] @ w [*In, *Out] (same dtype; the first n_in axes of w contracted)
    -> float32 [X, prod(Out)], accumulated in float32. w is reshaped to 2D inside, so the
    backward pass keeps w itself (in a layer scan: a slice of the stacked weights, which
    needs no stack of its own) rather than a reshaped copy of it."""
    return dot32(x, _as_2d(w, n_in))


def _as_2d(w: jax.Array, n_in: int) -> jax.Array:
    return w.reshape(int(np.prod(w.shape[:n_in])), -1)


def _matmul_fwd(x, w, n_in, transpose):
    return _matmul(x, w, n_in, transpose), (x, w)


def _matmul_bwd(n_in, transpose, res, g):
    # both gradient matmuls in the operands' dtype with float32 accumulation, like the
    # forward: autodiff would run them on the float32 cotangent, at float32 speed
    x, w = res
    w2 = _as_2d(w, n_in)
    g = g.astype(x.dtype)
    dx = dot32(g, transpose(w2)).astype(x.dtype)
    dw = dot32(transpose(x), g).astype(w.dtype)
    return dx, dw.reshape(w.shape)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x: jax.Array, w: jax.Array, n_in: int, dtype: Dtype, transpose: Callable = jnp.transpose) -> jax.Array:
    """x [..., *In] times w [*In, *Out] (the first n_in axes of w are contracted) as one
    2D matmul [X, prod(In)] x [prod(In), prod(Out)] in `dtype` with float32 accumulation,
    the result cast to `dtype`. The reshapes are free, no backend transposes a weight to
    fit a multi-axis einsum, and bf16 products stay bf16 in the backward pass too."""
    n_out = w.ndim - n_in
    n = int(np.prod(w.shape[:n_in]))
    y = _matmul(x.astype(dtype).reshape(-1, n), w.astype(dtype), n_in, transpose).astype(dtype)
    return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[w.ndim - n_out:])


def projection(module: nn.Module, path: str, x: jax.Array, n_in: int, dtype: Dtype,
               transpose: Callable = jnp.transpose) -> jax.Array:
    """x [..., *In] times the kernel at `path` [*In, *Out] (`dense`), plus its LoRA term
    (alpha / r) (x A) B when the module runs it with adapters (`has_adapters`); [..., *Out]
    in `dtype`. With B zero the term adds exact zeros: the base output, bit for bit."""
    y = dense(x, declared_param(module, path, module.param_dtype), n_in, dtype, transpose)
    if not has_adapters(module, path):
        return y
    a, b = lora_factors(module, path)
    xs = dense(x, a, n_in, dtype, transpose) * jnp.asarray(module.cfg.lora.scale, dtype)  # [..., r]
    return y + dense(xs, b, 1, dtype, transpose)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention. x [B, T, n, H] (n heads), positions int32[B, T]."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    transpose: Callable = jnp.transpose
    attention: Any = DENSE  # a `models.flash` variant: where it `handles(T, S)`, it runs
    PREFIX: ClassVar[str] = "layers/attn/"  # its params' paths in car_jax.params

    def _w(self, name):  # a weight, kept in its storage dtype until `dense` casts it
        return declared_param(self, self.PREFIX + name, self.param_dtype)

    def _p(self, name):  # in the compute dtype
        return self._w(name).astype(self.dtype)

    def _proj(self, x, name, n_in):  # x [..., *In] @ the kernel `name` [*In, *Out], with its adapters if any
        return projection(self, self.PREFIX + name, x, n_in, self.dtype, self.transpose)

    @nn.compact
    def __call__(self, x, positions, mask, kv, index):
        """x [B, T, D]; positions int32[B, T]; mask bool[B, T, S'] (which keys each query
        sees: a slot mask, `flash.slot_mask`). Without a cache (kv None) the keys are this
        chunk's own (S' = T). With one, kv is this layer's view of the cache
        (`cache.LayerKV` or `cache.StackedKV`): the chunk's keys and values are first written
        at slots [index, index + T), then every query attends over the layer's S slots
        (S' = S), reading the cache in place. Returns (y [B, T, D], the updated view or None)."""
        c = self.cfg
        n, k_heads, h = c.n_heads, c.n_kv_heads, c.head_dim
        q = self._proj(x, "q", 1)  # [D, N, H] -> [B, T, N, H]
        k = self._proj(x, "k", 1)  # [D, K, H] -> [B, T, K, H]
        v = self._proj(x, "v", 1)
        if c.qkv_bias:
            q = q + self._p("q_bias")  # [N, H]
            k = k + self._p("k_bias")  # [K, H]
            v = v + self._p("v_bias")
        if c.qk_norm:
            q = rms_norm(q, self._w("q_norm"), c.norm_eps, self.dtype)  # [H]
            k = rms_norm(k, self._w("k_norm"), c.norm_eps, self.dtype)
        q = rope(q, positions, c.rope_theta)
        k = rope(k, positions, c.rope_theta)

        b, t = x.shape[:2]

        def project(out):  # [B, T, K, G, H] -> [B, T, D]
            y = self._proj(out.reshape(b, t, n, h), "o", 2)  # [N, H, D]
            return y + self._p("o_bias") if c.out_bias else y  # [D]

        q = q.reshape(b, t, k_heads, c.n_groups, h) * (h ** -0.5)  # [B, T, K, G, H]
        if kv is None:
            out = self.attention(q, k, v, mask, 0) if self.attention.handles(t, t) else dense_attention(q, k, v, mask)
            return project(out), None
        # write first, then read the layer's whole cache: the buffers are updated in place
        keys, values, kv = kv.write(k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), index)  # [B, K, H, S], [B, K, S, H]
        if self.attention.handles(t, values.shape[2]):  # a long chunk (training, prefill), never a decode step
            out = self.attention(q.astype(keys.dtype), keys.transpose(0, 3, 1, 2), values.swapaxes(1, 2), mask, index)
            return project(out.astype(self.dtype)), kv
        # queries as [B, K, T*G, H], so both products are plain batched matmuls over the
        # cache: [T*G, H] @ [H, S] and [T*G, S] @ [S, H] (for a decode step, T = 1, the
        # transposes of q and of the output are free). They run in the cache's dtype,
        # reading it as it is stored.
        g, s, cd = c.n_groups, values.shape[2], keys.dtype
        qm = q.transpose(0, 2, 1, 3, 4).reshape(b, k_heads, t * g, h).astype(cd)
        scores = jnp.matmul(qm, keys, preferred_element_type=jnp.float32)  # [B, K, T*G, S]
        # the mask widened to the queries' T*G rows, so scores and probs keep one shape
        # (a reshape between them made autodiff keep both a [B, K, T, G, S] and a
        # [B, K, T*G, S] copy of the probabilities for the backward pass)
        mask = jnp.broadcast_to(mask[:, None, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
        probs = softmax(jnp.where(mask, scores, NEG)).astype(cd)
        out = jnp.matmul(probs, values).astype(self.dtype)  # [B, K, T*G, H]
        return project(out.reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4)), kv


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    transpose: Callable = jnp.transpose
    PREFIX: ClassVar[str] = "layers/mlp/"  # its params' paths in car_jax.params

    @nn.compact
    def __call__(self, x):  # x [B, T, D] -> [B, T, D]
        c = self.cfg
        w = lambda name: declared_param(self, self.PREFIX + name, self.param_dtype)
        cast = lambda a: a.astype(self.dtype)  # noqa: E731
        if not c.mlp_bias:  # one op that keeps 2 of the 4 [B, T, F] activations for backward
            wg, wu, wd = w("gate"), w("up"), w("down")  # [D, F], [D, F], [F, D]
            ab = tuple(tuple(map(cast, lora_factors(self, self.PREFIX + n))) if has_adapters(self, self.PREFIX + n)
                       else None for n in ("gate", "up", "down"))  # LoRA (A [in, r], B [r, out]) or None
            y = swiglu(*map(cast, (x.reshape(-1, c.d_model), wg, wu, wd)), transpose=self.transpose,
                       adapters=ab, scale=c.lora.scale)
            return y.reshape(x.shape)
        p = lambda name: cast(w(name))  # noqa: E731  with biases: the plain expression
        proj = partial(projection, self, dtype=self.dtype, transpose=self.transpose)
        gate = proj(self.PREFIX + "gate", x, 1) + p("gate_bias")  # [B, T, F]
        up = proj(self.PREFIX + "up", x, 1) + p("up_bias")
        y = proj(self.PREFIX + "down", jax.nn.silu(gate) * up, 1)
        return y + p("down_bias")


class Block(nn.Module):
    """One pre-norm layer; in a layer scan the carry is the residual stream."""
    cfg: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    transpose: Callable = jnp.transpose
    attention: Any = DENSE  # the policy's attention variant (`models.flash`)
    PREFIX: ClassVar[str] = "layers/"  # its params' paths in car_jax.params

    @nn.compact
    def __call__(self, x, positions, mask, kv, index):
        """x [B, T, D] -> (x [B, T, D], the updated cache view); arguments as `Attention`."""
        c = self.cfg
        norm = lambda name: declared_param(self, self.PREFIX + name, self.param_dtype)  # [D]
        h = rms_norm(x, norm("input_norm"), c.norm_eps, self.dtype)
        attention = Attention(c, self.dtype, self.param_dtype, self.transpose, self.attention, name="attn")
        attn, kv = attention(h, positions, mask, kv, index)
        x = x + attn
        h = rms_norm(x, norm("post_attn_norm"), c.norm_eps, self.dtype)
        x = x + Mlp(c, self.dtype, self.param_dtype, self.transpose, name="mlp")(h)
        return x, kv
