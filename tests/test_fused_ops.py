"""The ops with hand-written VJPs (models.fused) against autodiff of the plain
expressions they replace: values and gradients, float32 and bf16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.models import xla_cpu
from car_jax.models.fused import softmax, swiglu

# the backward passes' operand transposes: the plain policy's and XLA:CPU's real copy
TRANSPOSES = pytest.mark.parametrize("transpose", [jnp.transpose, xla_cpu.transposed], ids=["plain", "xla_cpu"])


def _plain_swiglu(x, wg, wu, wd):
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return dot(jax.nn.silu(dot(x, wg)) * dot(x, wu), wd)


def _arrays(dtype, n=37, d=24, f=40, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(n, d), (d, f), (d, f), (f, d)]
    args = [jnp.asarray(rng.normal(0, 1 if i == 0 else 0.3, s), dtype) for i, s in enumerate(shapes)]
    return args, jnp.asarray(rng.normal(size=(n, d)), dtype)


@TRANSPOSES
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_value_and_gradients(dtype, tol, transpose):
    args, cot = _arrays(dtype)
    loss = lambda f: (lambda *a: (f(*a).astype(jnp.float32) * cot.astype(jnp.float32)).sum())
    ours_fn = lambda *a: swiglu(*a, transpose=transpose)  # noqa: E731
    ours, theirs = ours_fn(*args), _plain_swiglu(*args)
    assert ours.dtype == dtype and ours.shape == (37, 24)
    scale = float(jnp.abs(theirs.astype(jnp.float32)).max())
    assert float(jnp.abs((ours - theirs).astype(jnp.float32)).max()) <= tol * scale
    g_ours = jax.grad(loss(ours_fn), argnums=(0, 1, 2, 3))(*args)
    # the reference gradient in float32: bf16 autodiff rounds each intermediate, ours
    # keeps the elementwise chain in float32, so both are compared to the exact one
    g_ref = jax.grad(loss(_plain_swiglu), argnums=(0, 1, 2, 3))(*(a.astype(jnp.float32) for a in args))
    for name, a, b in zip(["x", "wg", "wu", "wd"], g_ours, g_ref):
        assert a.dtype == dtype, name
        err = float(jnp.abs(a.astype(jnp.float32) - b).max())
        assert err <= tol * float(jnp.abs(b).max()), (name, err)


def test_softmax_value_and_gradient_with_masked_entries():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0, 3, (4, 5, 33)), jnp.float32)
    x = jnp.where(jnp.asarray(rng.random((4, 5, 33)) < 0.3), jnp.finfo(jnp.float32).min, x)
    x = x.at[..., 0].set(1.0)  # every row keeps one entry, as every query sees itself
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    np.testing.assert_allclose(softmax(x), jax.nn.softmax(x, axis=-1), atol=1e-7)
    g = jax.grad(lambda a: (softmax(a) * cot).sum())(x)
    g_ref = jax.grad(lambda a: (jax.nn.softmax(a, axis=-1) * cot).sum())(x)
    np.testing.assert_allclose(g, g_ref, atol=1e-6)
    # a hand-worked row: softmax([0, log 3]) = [1/4, 3/4]; d(y1)/dx = y1 * ([0, 1] - y1)
    g_row = jax.grad(lambda a: softmax(a)[1])(jnp.array([0.0, np.log(3.0)]))
    np.testing.assert_allclose(g_row, [-3 / 16, 3 / 16], atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_cpu_transposed_is_the_transpose(dtype):
    a = jnp.asarray(np.random.default_rng(2).normal(size=(5, 7)), dtype)
    got = jax.jit(xla_cpu.transposed)(a)
    assert got.shape == (7, 5) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(a, np.float32).T)
