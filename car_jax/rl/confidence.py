"""The policy's confidence distribution at its `<confidence>` tag, measured exactly.

A greedy episode states one number; the policy behind it holds a distribution over every
value it could have written. Here that distribution comes from one teacher-forced pass:
after the episode's own tokens up to its `<confidence>` tag (the prefix), each of the 101
continuations "value text + closing tag" (`" 37 </confidence>"`, so "5" and "55" are
different continuations) is scored by the sum of its tokens' log-probs, at temperature 1
on the raw logits, and

    P(v) = exp(sum_t logp(continuation_v)_t) / sum_u exp(sum_t logp(continuation_u)_t),
    v = 0..100;    expected q = sum_v P(v) v / 100.

The closing tag is part of each continuation: it ends the number, so the probability that
the model goes on from "5" to "55" is not counted as "5". Mass the policy puts on text that
is no value at all (a word, "85.5", a "%") is left out by the normalisation over the 101.

    dist = value_distribution(model, tokenizer, [prefix], tails=[tail])  # float64[1, 101]
    q = expected_q(dist)                                                   # float64[1]
    prefix, tail = confidence_prefix(traj.prompt_ids, traj.response_ids, tokenizer)

Tokenization (host). Each continuation is tokenized on its own with the tokenizer
(`add_special_tokens=False`), whatever it does with digits (SmolLM2 and Qwen2 write one
token per digit, a GPT-2-style BPE groups them): a continuation is as many tokens as its
text takes, and its ids must decode back to its text (a tokenizer that adds a leading
space to a lone string fails loudly). The prefix keeps the episode's own ids.

`confidence_prefix` finds the episode's last `<confidence>` tag in its decoded response.
When the token that completes the tag also carries text after it (Qwen2's ">\\n", SmolLM2's
">)"), the prefix backs up to the last token boundary at or before the tag's end and the
rest of the tag's text (">") opens every continuation. The layout after the tag is the
model's own: when the response closes that tag with something other than whitespace in
between, the whitespace the model wrote right after `<confidence>` and right before
`</confidence>` frame the value ("<confidence>85</confidence>": "{}</confidence>";
"<confidence>\\n85\\n</confidence>": "\\n{}\\n</confidence>"); otherwise (no closing tag, an
empty tag) the demonstrations' single spaces, " {} </confidence>". Only whitespace is
copied: a colon or a "%" the model wrote is not.

Batching (device). The B prefixes are left-padded to a length bucket P, the B x 101
continuations right-padded to a bucket R, and they run through the prompt-sharing forward
of the train step (`models.prompt_forward` via `rl.logprobs.response_logprobs`): each
prefix runs once and its 101 continuations read its keys and values. Calls take a fixed
number of prefixes each (a power of two sized to `max_bytes`, the last call padded with
copies), so a run compiles one program per (P, R) bucket. On a mesh (the model's) the
inputs are replicated, the rows of the forward split over fsdp, and every process must
call with the same arguments (a collective).

Letters (`car_jax.dims`): B prefixes (rows), P prefix length, R continuation length;
the 101 values are written out.
"""
from __future__ import annotations

import functools
import string
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax import hosts
from car_jax.models.decoder import Decoder
from car_jax.rl.logprobs import Prompts, response_logprobs
from car_jax.rl.steps import traced_on
from car_jax.rollout.generate import left_pad, length_bucket, round_up

VALUES = tuple(range(101))
OPEN, CLOSE = "<confidence>", "</confidence>"
DEFAULT_TAIL = " {} " + CLOSE  # the demonstrations' layout: "<confidence> 37 </confidence>"
MAX_BYTES = 1 << 30  # the default bound on one call's largest temporaries (`value_distribution`)


# ---------------------------------------------------------------- host: the prefix and its tail
def _decode(tokenizer, ids: Sequence[int]) -> str:
    """The ids' exact text (special tokens kept, no clean-up), so that the text of a prefix
    of the ids is a prefix of the text."""
    if not len(ids):
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _model_ranges(tokenizer, ids: list[int], sampled: Sequence[bool]) -> list[tuple[int, int]]:
    """[(start, end)) character ranges of the response text written by sampled tokens."""
    sampled = np.asarray(sampled, bool).reshape(-1)
    if len(sampled) != len(ids):
        raise ValueError(f"sampled has {len(sampled)} entries for {len(ids)} response ids")
    edges = [0, *(np.flatnonzero(np.diff(sampled.astype(np.int8))) + 1).tolist(), len(ids)]
    ends = [len(_decode(tokenizer, ids[:e])) for e in edges]
    return [(ends[i], ends[i + 1]) for i in range(len(edges) - 1) if edges[i + 1] > edges[i] and sampled[edges[i]]]


def _last_tag(text: str, ranges: list[tuple[int, int]] | None) -> int | None:
    """Where the last `<confidence>` of `text` starts (inside one of `ranges` if given)."""
    start = text.rfind(OPEN)
    while start != -1:
        end = start + len(OPEN)
        if ranges is None or any(a <= start and end <= b for a, b in ranges):
            return start
        start = text.rfind(OPEN, 0, start)
    return None


def _boundary(tokenizer, ids: list[int], text: str, end: int) -> int:
    """The most tokens k whose text ids[:k] decodes to a prefix of `text` no longer than
    `end` characters (binary search on the decoded length, then down to a clean prefix: a
    cut inside a multi-byte character decodes to a replacement character)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_decode(tokenizer, ids[:mid])) <= end:
            lo = mid
        else:
            hi = mid - 1
    while lo > 0 and not text.startswith(_decode(tokenizer, ids[:lo])):
        lo -= 1
    return lo


def _layout(after: str) -> tuple[str, str]:
    """(whitespace before the value, whitespace before the closing tag) as the model wrote
    them in `after`, the text that follows its tag; the demonstrations' (" ", " ") when it
    does not close the tag with something other than whitespace inside."""
    close = after.find(CLOSE)
    inner = after[:close] if close >= 0 else ""
    if not inner.strip():
        return " ", " "
    return inner[:len(inner) - len(inner.lstrip())], inner[len(inner.rstrip()):]


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def confidence_prefix(prompt_ids, response_ids, tokenizer, *,
                      sampled: Sequence[bool] | None = None) -> tuple[list[int], str] | None:
    """The episode's prefix ids up to its last <confidence> tag and the tail pattern for it
    (None: no tag).

    prompt_ids int[P], response_ids int[R] (an episode's `Trajectory` fields). Returns
    (prompt_ids + the response's ids up to the last token boundary at or before the tag's
    end, the tail: the rest of the tag's text, then the model's layout around "{}" and the
    closing tag; see the module docstring), a `value_distribution` row. `sampled` (bool[R],
    the trajectory's loss_mask) counts only tags the model wrote itself, never one inside a
    tool's observation."""
    ids = [int(i) for i in np.asarray(response_ids).reshape(-1)]
    text = _decode(tokenizer, ids)
    ranges = None if sampled is None else _model_ranges(tokenizer, ids, sampled)
    start = _last_tag(text, ranges)
    if start is None:
        return None
    end = start + len(OPEN)
    k = _boundary(tokenizer, ids, text, end)
    rest = text[len(_decode(tokenizer, ids[:k])):end]  # the tag's text the prefix does not hold
    lead, trail = _layout(text[end:])
    prefix = [int(i) for i in np.asarray(prompt_ids).reshape(-1)] + ids[:k]
    return prefix, _escape(rest + lead) + "{}" + _escape(trail + CLOSE)


def _check_tail(tail: str, row: int) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(tail) if f is not None]
    except ValueError as err:
        raise ValueError(f"tails[{row}]={tail!r} is not a str.format pattern ({err})") from None
    if fields != [""]:
        raise ValueError(f"tails[{row}]={tail!r} must hold exactly one '{{}}' (the value) and no other "
                         f"field, found {fields}; write literal braces as '{{{{' and '}}}}'")


def continuation_ids(tokenizer, tail: str, *, row: int = 0) -> list[list[int]]:
    """The 101 continuations of one tail pattern, tokenized on their own: [ids of
    tail.format(v) for v in VALUES]. Raises ValueError (naming `row`) for a pattern without
    exactly one '{}' or a continuation whose ids do not decode back to its text."""
    _check_tail(tail, row)
    out = []
    for v in VALUES:
        text = tail.format(v)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if _decode(tokenizer, ids) != text:
            raise ValueError(f"tails[{row}]={tail!r}: the tokenizer's ids for {text!r} decode to "
                             f"{_decode(tokenizer, ids)!r}; a continuation must be exactly its text "
                             "(a tokenizer that adds a leading space cannot score it)")
        if not ids:
            raise ValueError(f"tails[{row}]={tail!r}: {text!r} has no tokens")
        out.append(ids)
    return out


# ---------------------------------------------------------------- device: one batched pass
def _score(module: Decoder, params, prompt, prompt_valid, tokens, valid, prompt_index):
    """prompt int32[U, P] left-padded (prompt_valid bool[U, P]); tokens int32[X, R]
    right-padded (valid bool[X, R]), row x after prompt prompt_index[x] -> float32[X]: the
    summed log-probs (temperature 1) of each row's valid tokens. The head runs one
    position at a time, so one [X, V] block of logits exists at once."""
    logp, _ = response_logprobs(module, params, Prompts(prompt, prompt_valid, prompt_index), tokens, valid, chunk=1)
    return jnp.sum(jnp.where(valid, logp, 0.0), axis=1)


@functools.lru_cache(maxsize=8)
def _scorer(module: Decoder, mesh: Mesh | None):
    """`_score` jitted once per (module, mesh); on a mesh traced with it in context (the
    forward's rows over fsdp) and returned replicated."""
    fn = functools.partial(_score, module)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(traced_on(mesh, fn), out_shardings=NamedSharding(mesh, P()))


def prefixes_per_call(model, n: int, prefix_len: int, cont_len: int, *, max_bytes: int = MAX_BYTES) -> int:
    """How many prefixes (each with its 101 continuations) one call takes, for n of them:
    the smallest power of two that holds all n, or else the largest whose estimated
    temporaries fit `max_bytes` (at least 1); rounded up to a multiple of the mesh's fsdp.
    The estimate per prefix: each continuation row's gathered
    keys and values of one layer (2 (P + R) K H in the cache dtype) and one position's
    logits (3 V float32: logits, exponentials, a product), plus the prefix's dense
    attention scores (N P^2 float32)."""
    c, module = model.config, model.module
    kv_item = jnp.dtype(module.policy.cache_dtype(module.dtype)).itemsize
    row = 2 * (prefix_len + cont_len) * c.n_kv_heads * c.head_dim * kv_item + 3 * c.vocab_size * 4
    per_prefix = len(VALUES) * row + c.n_heads * prefix_len * prefix_len * 4
    g = 1
    while g < n and 2 * g * per_prefix <= max_bytes:
        g *= 2
    return round_up(g, 1 if model.mesh is None else model.mesh.shape["fsdp"])


def _place(model, *arrays):
    """Host arrays as the jitted pass takes them: on the first device, or replicated on
    the mesh (equal in every process)."""
    return [hosts.to_global(a, model.mesh, P()) for a in arrays]


def _pass(model, prefixes: list[list[int]], conts: list[list[list[int]]], pad_id: int, g: int,
          width: int, cont_width: int) -> np.ndarray:
    """One call: g prefixes (fewer are padded with copies of the last) -> float64[len, 101]
    summed continuation log-probs."""
    n = len(prefixes)
    prefixes = prefixes + [prefixes[-1]] * (g - n)
    conts = conts + [conts[-1]] * (g - n)
    prompt, prompt_valid = left_pad(prefixes, width, pad_id)  # [g, P]
    rows = [ids for per in conts for ids in per]  # g * 101 rows, prefix-major
    tokens = np.full((len(rows), cont_width), pad_id, np.int32)
    valid = np.zeros((len(rows), cont_width), bool)
    for x, ids in enumerate(rows):
        tokens[x, :len(ids)], valid[x, :len(ids)] = ids, True
    index = np.repeat(np.arange(g, dtype=np.int32), len(VALUES))
    args = _place(model, prompt, prompt_valid, tokens, valid, index)
    out = _scorer(model.module, model.mesh)(model.params, *args)
    return hosts.gather_full(out).astype(np.float64).reshape(g, len(VALUES))[:n]


def value_distribution(model, tokenizer, prefixes, tails=DEFAULT_TAIL, *, max_bytes: int = MAX_BYTES) -> np.ndarray:
    """model: car_jax.loading.Model (config, params, module, mesh); prefixes: B
    token-id sequences, each ending right after a `<confidence>` tag (or before the tag's
    rest, which its tail then starts with: `confidence_prefix`); tails: one str.format
    pattern for all rows or one per row, with {} the value. -> float64[B, 101]
    probabilities: P(v) over v = 0..100 of the continuation tails[b].format(v) after
    prefixes[b] (module docstring). `max_bytes` bounds one call's temporaries
    (`prefixes_per_call`). On a mesh every process calls it with the same arguments."""
    rows = [[int(i) for i in np.asarray(p).reshape(-1)] for p in prefixes]
    tails = [tails] * len(rows) if isinstance(tails, str) else list(tails)
    if len(tails) != len(rows):
        raise ValueError(f"{len(tails)} tails for {len(rows)} prefixes: give one pattern, or one per prefix")
    if not rows:
        return np.zeros((0, len(VALUES)), np.float64)
    if empty := [b for b, r in enumerate(rows) if not r]:
        raise ValueError(f"prefixes[{empty[0]}] is empty: a prefix holds at least the tokens of its tag")
    by_tail: dict[str, list[list[int]]] = {}
    for b, tail in enumerate(tails):
        if tail not in by_tail:
            by_tail[tail] = continuation_ids(tokenizer, tail, row=b)
    conts = [by_tail[t] for t in tails]
    width = length_bucket(max(len(r) for r in rows), 16)
    cont_width = length_bucket(max(len(ids) for per in by_tail.values() for ids in per), 8)
    g = prefixes_per_call(model, len(rows), width, cont_width, max_bytes=max_bytes)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    logp = np.concatenate([_pass(model, rows[s:s + g], conts[s:s + g], pad_id, g, width, cont_width)
                           for s in range(0, len(rows), g)])
    logp -= logp.max(axis=1, keepdims=True)  # softmax over the 101 values, in float64
    p = np.exp(logp)
    return p / p.sum(axis=1, keepdims=True)


def expected_q(dist: np.ndarray) -> np.ndarray:
    """float64[B, 101] value probabilities -> float64[B]: sum_v P(v) v / 100."""
    dist = np.asarray(dist, np.float64)
    if dist.ndim != 2 or dist.shape[1] != len(VALUES):
        raise ValueError(f"dist has shape {dist.shape}; expected [B, {len(VALUES)}] (one probability per value 0..100)")
    return dist @ (np.asarray(VALUES, np.float64) / 100.0)


def mode_value(dist: np.ndarray) -> np.ndarray:
    """float64[B, 101] -> int64[B]: the most probable value of each row (the lowest on ties)."""
    return np.argmax(np.asarray(dist), axis=1)


__all__ = ["DEFAULT_TAIL", "VALUES", "confidence_prefix", "continuation_ids", "expected_q", "mode_value",
           "prefixes_per_call", "value_distribution"]
