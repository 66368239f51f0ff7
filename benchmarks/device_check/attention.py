"""Section attention: the flash (blockwise) attention and the fused cuDNN one against dense
attention on the device, values and gradients, fp32 and bf16.

Inputs as the model builds them (`car_jax.models.flash`): q [B, T, K, G, H] (GQA: G query
heads per kv head), k / v [B, S, K, H], a slot mask from key_ok bool[B, S] at a cache
offset. Rows: left-padded, right-padded, random holes, and (tiny) one with no valid key
(each query then sees only its own slot). Cases: self-attention over a whole sequence
(offset 0) and a chunk written at a cache offset, block sizes that divide neither T nor S
at tiny shapes, the accelerator policy's blocks (`policy.ACCELERATOR_ATTENTION`) at full
ones. Each variant's output and its gradients w.r.t. q, k, v (the vjp of a random
cotangent) are compared, over every element:

- fp32: |variant - dense| <= FP32_TOL x max(1, |dense| max), matmuls at "highest";
- bf16 (inputs rounded to bf16): both dense-bf16 and the variant against dense fp32 over
  the same rounded inputs (the reference); the variant's error <= BF16_FACTOR x dense
  bf16's own error + BF16_FLOOR x max(1, |reference| max): flash must not be less exact
  than the attention it replaces.

Variants: `flash.Blockwise` everywhere; `flash.Fused("cudnn")` on a GPU, bf16 only (cuDNN's
flash kernel takes no fp32); on other backends, in its place, `flash.Fused("xla")` (the same
wiring through XLA's implementation; tests/test_flash_attention.py checks it in fp32).
Timings (seconds per forward + backward, after a compile) are reported at full shapes, not
checked.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from .common import Options, Part, block, check, max_abs, scale

FP32_TOL = 2e-5
BF16_FACTOR = 2.0
BF16_FLOOR = 2.0 ** -9


@dataclasses.dataclass(frozen=True)
class Case:
    t: int  # queries
    s: int  # keys (cache slots)
    offset: int  # slot of the first query
    block_q: int
    block_k: int


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int  # B
    heads: tuple[int, int, int]  # K kv heads, G query heads per kv head, H head dim
    cases: dict[str, Case]
    timed: bool


TINY = Shape(4, (2, 3, 8), {"causal": Case(13, 13, 0, 4, 3), "cache_offset": Case(9, 20, 5, 4, 6)}, timed=False)
# Qwen2.5-3B's heads (16 query heads over 2 kv heads of 128), the accelerator policy's 512 blocks
FULL = Shape(2, (2, 8, 128), {"causal": Case(2048, 2048, 0, 512, 512),
                             "cache_offset": Case(1024, 4096, 1536, 512, 512)}, timed=True)


def key_ok(rows: int, s: int, offset: int, t: int, rng) -> np.ndarray:
    """bool[B, S]: row 0 left-padded, row 1 right-padded (before the chunk's end), row 2
    with random holes, further rows whole; with 4 rows or more, row 3 has no valid key.
    Slots after the chunk's last one are empty, as in a cache."""
    ok = np.ones((rows, s), bool)
    ok[0, : max(1, s // 5)] = False
    ok[1, max(1, (offset + t) * 3 // 4):] = False
    if rows > 2:
        ok[2] = rng.random(s) > 0.3
    if rows > 3:
        ok[3] = False
    ok[:, offset + t:] = False
    return ok


def variants(backend: str, case: Case, dtype: str) -> dict:
    from car_jax.models import flash
    out = {"blockwise": flash.Blockwise(case.block_q, case.block_k, min_scores=0)}
    if dtype == "bfloat16":  # cuDNN's fused kernel takes bf16 / fp16 only
        out["cudnn" if backend == "gpu" else "fused_xla"] = flash.Fused("cudnn" if backend == "gpu" else "xla")
    return out


def _program(attend, mask, offset):
    """Jitted (q, k, v, ct) -> (out, (dq, dk, dv)) of attend(q, k, v, mask, offset)."""
    import jax

    @jax.jit
    def f(q, k, v, ct):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, mask, offset), q, k, v)
        return out, vjp(ct)
    return f


def _errors(got, want) -> dict:
    names = ("out", "dq", "dk", "dv")
    flat_got, flat_want = [got[0], *got[1]], [want[0], *want[1]]
    return {n: (max_abs(g, w), scale(w)) for n, g, w in zip(names, flat_got, flat_want)}


def _time(f, args) -> float:
    start = time.perf_counter()
    block(f(*args))
    return time.perf_counter() - start


def run_case(name: str, case: Case, shape: Shape, backend: str, part: Part) -> dict:
    import jax
    import jax.numpy as jnp

    from car_jax.models import flash
    k_heads, g, h = shape.heads
    rng = np.random.default_rng(len(name))
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    q = normal(shape.rows, case.t, k_heads, g, h) * h ** -0.5  # scaled, as the layer hands it over
    k, v, ct = normal(shape.rows, case.s, k_heads, h), normal(shape.rows, case.s, k_heads, h), \
        normal(shape.rows, case.t, k_heads, g, h)
    mask = flash.slot_mask(jnp.asarray(key_ok(shape.rows, case.s, case.offset, case.t, rng)), case.offset, case.t)
    reference = _program(flash.DENSE, mask, case.offset)  # one jit: a program per input dtype
    result, checks = {}, {}
    with jax.default_matmul_precision("highest"):
        for dtype in ("float32", "bfloat16"):
            args = [jnp.asarray(a, dtype) for a in (q, k, v, ct)]
            want = reference(*[a.astype(jnp.float32) for a in args])  # fp32 over the (rounded) inputs
            own = reference(*args) if dtype == "bfloat16" else want
            base = _errors(own, want)  # dense's own error (0 in fp32)
            timings = {"dense": _time(reference, args)} if shape.timed else {}
            for vname, variant in variants(backend, case, dtype).items():
                key = f"{name}/{dtype}/{vname}"
                try:
                    f = _program(variant, mask, case.offset)
                    errs = _errors(f(*args), want)
                    if shape.timed:
                        timings[vname] = _time(f, args)
                except Exception as e:  # noqa: BLE001 - a variant the backend refuses: reported, the rest goes on
                    checks[key] = check(False, error=f"{type(e).__name__}: {e}"[:500])
                    continue
                for arr, (err, size) in errs.items():
                    limit = (FP32_TOL * size if dtype == "float32"
                             else BF16_FACTOR * base[arr][0] + BF16_FLOOR * size)
                    checks[f"{key}/{arr}"] = check(err <= limit, err, limit)
                result[key] = {arr: err for arr, (err, _) in errs.items()}
            if dtype == "bfloat16":
                result[f"{name}/bfloat16/dense"] = {arr: err for arr, (err, _) in base.items()}
            if timings:
                result[f"{name}/{dtype}/seconds_fwd_bwd"] = timings
    part(name, {"errors": result, "ok": all(c["ok"] for c in checks.values())})
    return {"errors": result, "checks": checks}


def run(opts: Options, part: Part) -> dict:
    import jax
    shape = TINY if opts.tiny else FULL
    backend = jax.default_backend()
    out = {"rows": shape.rows, "kv_heads_groups_head_dim": list(shape.heads),
           "cases": {n: dataclasses.asdict(c) for n, c in shape.cases.items()}, "errors": {}, "checks": {}}
    for name, case in shape.cases.items():
        r = run_case(name, case, shape, backend, part)
        out["errors"].update(r["errors"])
        out["checks"].update(r["checks"])
    return out


def summary(r: dict) -> str:
    checks = r["checks"]
    ok = sum(c["ok"] for c in checks.values())
    ratios = {k: c["value"] / c["limit"] for k, c in checks.items() if "limit" in c and c["limit"]}
    worst = max(ratios, key=ratios.get) if ratios else None
    line = f"{ok}/{len(checks)} comparisons within tolerance"
    if worst:
        line += f"; worst error / limit {ratios[worst]:.2f} ({worst})"
    for key, times in r["errors"].items():
        if key.endswith("seconds_fwd_bwd"):
            line += f"; {key[:-len('/seconds_fwd_bwd')]} fwd+bwd " + ", ".join(f"{v} {s * 1e3:.1f} ms"
                                                                            for v, s in times.items())
    return line
