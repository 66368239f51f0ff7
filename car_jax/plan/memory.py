"""The planner's byte counts: what each device holds during a GRPO step, from the
architecture, the mesh and the config, without weights or a compile.

Every figure is per device. The layouts are the sharding table's (`car_jax.sharding`):
weights and their gradients / moments split as RULES["train"] says (embed over fsdp;
heads, kv heads, mlp and vocab over tp), the KV cache as RULES["sample"] says (rows over
fsdp, kv heads over tp), batch rows over fsdp, and within a tp group every device holds the
residual stream [X, D] of its rows whole and 1/tp of the heads, mlp and vocabulary.

Two phases share the chip, and the peak is the larger:
  rollout = params + optimizer state + reference + KV cache
            + the larger of: the rollout's temporaries (the widest prefill's, or the decode
              loop's: logits and the sampler's sort) + gathered weights (fsdp > 1), inside a
              program; and the narrowed cache of the engine's tail with its logits, between
              programs (`narrowing_bytes`: for a moment both caches exist)
  train   = params + optimizer state + reference + the step's batch (every row's arrays)
            + gradients + gathered weights and their gradients (fsdp > 1;
              `train_gathered_bytes`) + activations (the train step's temporaries)
Gradients: the running sum over micro-batches and one micro-batch's, both in the param
dtype. With LoRA (`model.lora.rank` > 0) the params are the base in its storage dtype plus the
adapters (float32), and the gradients and AdamW moments cover the adapters alone; there is
no reference copy (the base with the adapters off is the reference). Over fsdp the LoRA
train step holds the gathered head once (frozen: no gradient) and 2.5 layers' gathered
weights (`train_gathered_bytes`): no weight gradients, but XLA keeps the gathered weights of
more than one layer live around each layer's backward pass (2.1 to 3.0 layers' worth on
Qwen2.5-7B over 8x1, 4x2 and 2x4 meshes, with and without remat; tests/test_plan_lora.py).
With fsdp > 1 both phases gather one layer's and the vocabulary head's weights
whole, and the train step holds their gradients before the reduce-scatter (`gathered_bytes`).
Activations of one micro-batch (b = micro rows / fsdp rows, X = b (P + R) tokens):
with remat, each layer's input (L x X x D) and one layer's forward and backward working set;
without, every layer's saved residuals (`layer_saved`). Attention residuals: float32
scores and probabilities [T, S] per head where the dense attention runs, the output and
its logsumexp where the blockwise one runs (`policy.ACCELERATOR_ATTENTION.handles`). The
vocabulary head holds a chunk's float32 logits and their gradient [b C, V / tp]
(`head_loss`). The coefficients (how many buffers of each kind are live at once) are
counted from XLA's buffer assignment of the train step and checked against
`memory_analysis()` in tests/test_plan.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import sharding as shd
from car_jax.models import lora
from car_jax.models.config import ModelConfig, as_dtype
from car_jax.models.decoder import Decoder
from car_jax.models.policy import PLAIN
from car_jax.plan.shapes import Shapes
from car_jax.train.config import PolicyConfig

HEAD_CHUNK = 128  # positions per vocabulary chunk of the train step's head (`head_loss`, `chunked_head`)


class PlanError(ValueError):
    """A mesh, chip or config the planner cannot lay out; the message names the value and the fix."""


def mesh_size(axis: str | None, fsdp: int, tp: int) -> int:
    return {"fsdp": fsdp, "tp": tp}.get(axis, 1)


def param_shapes(model: ModelConfig, policy: PolicyConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """{"layers/attn/q": ShapeDtypeStruct, ...}: the Decoder's param tree from `jax.eval_shape`
    of its init (no weights), in the storage dtype; with `model.lora`'s adapters (float32)."""
    module = Decoder(model, dtype=as_dtype(policy.dtype), param_dtype=as_dtype(policy.param_dtype), policy=PLAIN)
    tree = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    return shd.flatten_params(tree)


def local_size(name: str, shape, logical, fsdp: int, tp: int, mode: str = "train") -> int:
    """Elements of one device's shard of an array with these logical axes (the sharding
    table's `mode` rules). Raises PlanError when a split dimension does not divide."""
    n = 1
    for dim, (size, axis) in enumerate(zip(shape, logical)):
        mesh_axis = shd.RULES[mode].get(axis)
        parts = mesh_size(mesh_axis, fsdp, tp)
        if size % parts:
            raise PlanError(f"--mesh: {name} dim {dim} ({axis}={size}) does not split over {mesh_axis}={parts}; "
                            f"pick a {mesh_axis} size that divides {size}")
        n *= size // parts
    return n


def params_per_device(shapes: dict[str, jax.ShapeDtypeStruct], fsdp: int, tp: int) -> int:
    """Elements of the params one device holds in the train layout."""
    return sum(local_size(p, x.shape, shd.PARAM_AXES[p], fsdp, tp) for p, x in shapes.items())


def bytes_per_device(shapes: dict[str, jax.ShapeDtypeStruct], fsdp: int, tp: int) -> int:
    """Bytes of the params one device holds in the train layout, each in its own dtype (a
    LoRA model's adapters are float32 over a base in its storage dtype)."""
    return sum(local_size(p, x.shape, shd.PARAM_AXES[p], fsdp, tp) * np.dtype(x.dtype).itemsize
               for p, x in shapes.items())


def adapter_shapes(shapes: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """The LoRA adapters of a param tree (`models.lora.is_adapter`), what a LoRA run trains."""
    return {p: x for p, x in shapes.items() if lora.is_adapter(p)}


def gathered_bytes(shapes: dict[str, jax.ShapeDtypeStruct], fsdp: int, tp: int) -> int:
    """Bytes of the weights a program on the train layout holds whole over fsdp at a time (0
    when fsdp = 1): one layer's, gathered for its matmuls (D whole, 1/tp of the heads / mlp),
    and the vocabulary head's [D, V / tp] (lm_head, or the tied embedding), each in its
    dtype. The train step holds their gradients before the reduce-scatter as well (as many
    bytes again; with LoRA, as many bytes of gathered weights: see the module docstring);
    the rollout, which samples with the train state's params, holds the weights only."""
    return sum(_gathered_parts(shapes, fsdp, tp))


def _gathered_parts(shapes: dict[str, jax.ShapeDtypeStruct], fsdp: int, tp: int) -> tuple[int, int]:
    """(one layer's, the head's) bytes of weights gathered whole over fsdp ((0, 0) for fsdp = 1)."""
    if fsdp == 1:
        return 0, 0

    def nbytes(p, x, shape, logical):
        return local_size(p, shape, logical, 1, tp) * np.dtype(x.dtype).itemsize

    layer = sum(nbytes(p, x, x.shape[1:], shd.PARAM_AXES[p][1:]) for p, x in shapes.items() if p.startswith("layers/"))
    head = "lm_head" if "lm_head" in shapes else "embed"
    return layer, nbytes(head, shapes[head], shapes[head].shape, shd.PARAM_AXES[head])


LORA_GATHERED_LAYERS = 2.5  # layers' gathered weights a LoRA train step holds at once (measured 2.1 to 3.0)


def train_gathered_bytes(shapes: dict[str, jax.ShapeDtypeStruct], fsdp: int, tp: int, lora_rank: int) -> int:
    """What the train step holds of weights gathered over fsdp: the gathered weights and their
    gradients (2 x `gathered_bytes`); with LoRA the head once and `LORA_GATHERED_LAYERS`
    layers' weights (no weight gradients; module docstring)."""
    layer, head = _gathered_parts(shapes, fsdp, tp)
    return int(head + LORA_GATHERED_LAYERS * layer) if lora_rank else 2 * (layer + head)


def _split(name: str, size: int, parts: int, axis: str) -> int:
    if size % parts:
        raise PlanError(f"--mesh: {name}={size} does not split over {axis}={parts}; pick a {axis} size that "
                        f"divides {size}")
    return size // parts


def head_chunk(r: int, chunk: int = HEAD_CHUNK) -> int:
    """C: positions per vocabulary chunk of R positions (`logprobs.to_chunks`)."""
    return -(-r // -(-r // chunk))


def _dense(t: int, s: int) -> bool:
    """Whether the accelerator policy runs the dense attention over T queries and S keys."""
    return not PLAIN.attention.handles(t, s)


def attention_residuals(model: ModelConfig, rows: int, t: int, s: int, tp: int, cb: int) -> int:
    """Bytes one layer keeps for the backward pass of its attention over T queries and S
    keys: float32 scores and the probabilities (compute dtype) [rows, N/tp, T, S] when dense;
    the output's float32 logsumexp [rows, N/tp, T] when blockwise."""
    n = model.n_heads // tp
    if _dense(t, s):
        return rows * n * t * s * (4 + cb)
    return rows * n * t * 4


def layer_saved(model: ModelConfig, rows: int, p: int, r: int, tp: int, cb: int) -> int:
    """Bytes one layer's forward keeps for its backward (no remat) over `rows` rows of P
    prompt and R response tokens: per token the residual stream, both norms' outputs and the
    attention's output projection input (4 D), q, k, v and the attention output
    ((2N + 2K) H / tp), the MLP's gate and up (2 F / tp), in the compute dtype; plus the
    attention residuals of the prompt (P x P) and the responses (R x (P + R))."""
    c = model
    x = rows * (p + r)
    per_token = 4 * c.d_model + (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim // tp + 2 * c.mlp_dim // tp
    return (x * per_token * cb + attention_residuals(c, rows, p, p, tp, cb)
            + attention_residuals(c, rows, r, p + r, tp, cb))


def layer_work(model: ModelConfig, rows: int, p: int, r: int, tp: int, cb: int) -> int:
    """Bytes live while one layer runs its backward pass (its residuals, recomputed under
    remat, and their gradients), as XLA's buffer assignment of the train step holds them:
    about 4.5 [X, F / tp] buffers, 4 D + 2 (N + 2K) H / tp per token, and 1.3 float32
    score buffers of the dense attention (fitted on compiled tiny models, tests/test_plan.py)."""
    c = model
    x = rows * (p + r)
    per_token = 4.5 * c.mlp_dim / tp + 4 * c.d_model + 2 * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim / tp
    n = c.n_heads // tp
    scores = sum(rows * n * t * s * 4 for t, s in ((p, p), (r, p + r)) if _dense(t, s))
    return int(x * per_token * cb + 1.3 * scores)


def activation_bytes(model: ModelConfig, shapes: Shapes, cb: int, remat: bool) -> int:
    """The train step's activation bytes for one micro-batch on one device: the layers'
    saved inputs (remat: L x X x D) or residuals (L x `layer_saved`), plus the larger of
    one layer's backward (`layer_work`) and the vocabulary head's chunk (float32 logits
    and their gradient [b C, V / tp], the hidden states and their gradient [b, R, D])."""
    c, sh = model, shapes
    b = _split("rl.micro_batch", sh.micro_rows, sh.fsdp, "fsdp")
    x = b * (sh.prompt + sh.response)
    stack = c.n_layers * (x * c.d_model * cb if remat else layer_saved(c, b, sh.prompt, sh.response, sh.tp, cb))
    head = 3 * b * head_chunk(sh.response) * (c.vocab_size // sh.tp) * 4 + 2 * b * sh.response * c.d_model * 4
    return stack + max(layer_work(c, b, sh.prompt, sh.response, sh.tp, cb), head)


def _cache_row_bytes(model: ModelConfig, shapes: Shapes, cb: int) -> int:
    """One cache row on one device: keys and values [L, K / tp, S, H] in the cache dtype
    (the compute dtype on accelerators), plus its S slot flags."""
    c, sh = model, shapes
    k = _split("num_key_value_heads", c.n_kv_heads, sh.tp, "tp")
    return 2 * c.n_layers * k * sh.capacity * c.head_dim * cb + sh.capacity


def kv_cache_bytes(model: ModelConfig, shapes: Shapes, cb: int) -> int:
    """The rollout's caches on one device (decode and park rows): rows / fsdp cache rows."""
    return _split("rollout rows", shapes.rollout_rows, shapes.fsdp, "fsdp") * _cache_row_bytes(model, shapes, cb)


def narrowing_bytes(model: ModelConfig, shapes: Shapes, cb: int) -> int:
    """What the episode engine allocates beside its caches when its tail narrows the decode
    rows (`shapes.narrow_rows`, half the decode rows; the wider cache is freed after the
    rows move): the narrowed cache and its float32 next-token logits [rows, V], rows over
    fsdp (rounded up). With no park, the KV memory is 1.5 x the rollout rows for a moment."""
    rows = -(-shapes.narrow_rows // shapes.fsdp)
    return rows * (_cache_row_bytes(model, shapes, cb) + model.vocab_size * 4)


def rollout_temp_bytes(model: ModelConfig, shapes: Shapes, cb: int) -> int:
    """The rollout's temporaries on one device, the larger of the widest prefill's (one
    layer's activations over rows x T tokens: 2 D + (N + 2K) H / tp + 1.5 F / tp per token;
    a float32 score buffer over the cache where the attention is dense) and the decode
    loop's (float32 logits [rows, V] and the sampler's sort over them, 8 such buffers)."""
    c, sh = model, shapes
    rows = sh.rollout_rows // sh.fsdp
    t = sh.prefill_chunk
    x = rows * t
    layer = x * (2 * c.d_model + (c.n_heads + 2 * c.n_kv_heads) * c.head_dim // sh.tp + 1.5 * c.mlp_dim / sh.tp) * cb
    n = c.n_heads // sh.tp
    attn = rows * n * t * sh.capacity * 4 if _dense(t, sh.capacity) else rows * n * t * 4 * 2
    prefill = layer + attn + x * c.d_model * cb + rows * c.vocab_size * 4
    decode = 8 * rows * c.vocab_size * 4
    return int(max(prefill, decode))


def batch_bytes(shapes: Shapes) -> tuple[int, int]:
    """(the train step's mini-batch input, the step's TrainBatch) on one device: per row
    prompt int32 + bool [P], tokens int32, valid bool and four float32 [R] (mask, old, ref
    and sampler log-probs), the advantage."""
    sh = shapes
    row = sh.prompt * 5 + sh.response * (4 + 1 + 4 * 4) + 8
    mini = sh.micro_batches * sh.micro_rows // sh.fsdp * row
    step = sh.step_rows // sh.fsdp * (sh.response * (4 + 1 + 4 * 4) + 16)
    return mini, step


def dtype_bytes(name: str) -> int:
    return np.dtype(as_dtype(name)).itemsize


__all__ = ["PlanError", "param_shapes", "params_per_device", "bytes_per_device", "adapter_shapes", "gathered_bytes",
           "train_gathered_bytes", "activation_bytes", "kv_cache_bytes",
           "narrowing_bytes", "rollout_temp_bytes", "batch_bytes", "dtype_bytes", "head_chunk", "local_size"]
