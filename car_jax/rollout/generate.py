"""`generate`: batched text generation with the jitted prefill (`prefill.py`) and the decode
loop (`decode.DecodeLoop`), one segment per row."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import hosts
from car_jax.models.policy import backend_policy
from car_jax.rollout.decode import DecodeLoop, SegmentOut
from car_jax.rollout.prefill import prefill, prefill_distinct
from car_jax.rollout.sampling import Sampler
from car_jax.rollout.stops import stop_tables

BUCKET = 16  # prefill lengths are padded to a multiple of this, to bound recompiles


def round_up(n: int, multiple: int = BUCKET) -> int:
    return -(-n // multiple) * multiple


def length_bucket(n: int, smallest: int = 64) -> int:
    """The smallest of 64, 96, 128, 192, 256, 384, ... (powers of two and 1.5x them) that
    holds n: training batches come in few shapes (few compiles), wasting at most a third."""
    size = smallest
    while size < n:
        size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    return size


def decode_windows(index: int, max_steps: int, capacity: int, stages: int | None = None) -> tuple[int, ...]:
    """The slot windows of a decode segment of `max_steps` tokens that starts at slot
    `index` (`DecodeLoop.windows`): the `length_bucket` sizes its tokens pass
    through (few shapes compile), capped at the capacity, at most the last `stages` of
    them (default: the `decode_stages` of the backend's execution policy,
    `policy.backend_policy()`); each is one more loop to compile. The segment then
    attends over the slots it can reach, not over the empty rest of a cache sized for a
    whole multi-turn episode, and its early tokens over fewer slots than its last."""
    stages = backend_policy().decode_stages if stages is None else stages
    if index + max_steps > capacity:
        raise ValueError(f"a segment of {max_steps} tokens from slot {index} overflows the cache "
                         f"(capacity {capacity}); allocate at least {index + max_steps} slots")
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    sizes = [min(length_bucket(index + 1), capacity)]
    while sizes[-1] < index + max_steps:
        sizes.append(min(length_bucket(sizes[-1] + 1), capacity))
    return tuple(sizes[-stages:])


def prompt_texts(tokenizer, prompts: Sequence) -> list[str]:
    """Strings pass through; a list of chat messages gets the chat template."""
    return [p if isinstance(p, str) else
            tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
            for p in prompts]


def left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32[B, width], valid bool[B, width]) with each row flush right."""
    tokens = np.full((len(rows), width), pad_id, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        if len(row):
            tokens[b, width - len(row):] = row
            valid[b, width - len(row):] = True
    return tokens, valid


def eos_ids(model, tokenizer) -> np.ndarray:
    ids = set(model.config.eos_token_id)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for special in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(special)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i is not None and i >= 0:
            ids.add(i)
    return np.array(sorted(ids), np.int32)


def prefill_prompts(model, prompt_ids: Sequence[Sequence[int]], extra: int, pad_id: int):
    """Left-pads the prompts to one width P (a multiple of BUCKET), allocates a cache of
    P + extra slots and prefills it. On one device each distinct prompt runs once (the
    copies of a GRPO group share a forward) and its rows get copies of its cache; on a
    mesh, where rows are split over devices, every row runs. With several processes,
    `prompt_ids` are this process's rows (`hosts.local_rows`; as many in every process), P
    is the widest of all processes' and the cache holds every process's rows. Returns
    (logits float32[B, V], cache, prefilled tokens of this process's rows)."""
    width = round_up(hosts.global_max(max(len(p) for p in prompt_ids)))
    cache = model.init_cache(len(prompt_ids) * hosts.count(), width + extra)
    ids: dict[tuple[int, ...], int] = {}
    inverse = np.array([ids.setdefault(tuple(p), len(ids)) for p in prompt_ids], np.int32)
    if model.mesh is None and len(ids) < len(prompt_ids):
        tokens, valid = left_pad(list(ids), width, pad_id)
        logits, cache = prefill_distinct(model.module, params=model.params, cache=cache, tokens=jnp.asarray(tokens),
                                         valid=jnp.asarray(valid), inverse=jnp.asarray(inverse))
    else:
        tokens, valid = left_pad(prompt_ids, width, pad_id)
        logits, cache = prefill(model.module, model.params, cache, hosts.to_global(tokens, model.mesh),
                                hosts.to_global(valid, model.mesh))
    return logits, cache, int(valid.sum())


def generate_ids(model, tokenizer, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
                 sampler: Sampler = Sampler(), stop: Sequence = (), seed: int = 0,
                 eos: np.ndarray | None = None) -> SegmentOut:
    """Token-level generation for prompts given as id lists; returns the SegmentOut
    (sampled ids, recorded log-probs, lengths, stop flags) as numpy arrays (with several
    processes: each process passes and gets back its own rows, `hosts.local_rows`). `eos`:
    the ids that end a row (default `eos_ids`; an empty array turns EOS off). The decode
    loop runs in up to the model's execution policy's `decode_stages` stages of growing
    cache windows (`decode_windows`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    logits, cache, _ = prefill_prompts(model, prompt_ids, max_new_tokens, tokenizer.pad_token_id or 0)
    tables = jnp.asarray(stop_tables(tokenizer, stop))
    eos = eos_ids(model, tokenizer) if eos is None else eos
    active = hosts.to_global(np.array([len(p) > 0 for p in prompt_ids]), model.mesh)
    loop = DecodeLoop(module=model.module, sampler=sampler, max_steps=max_new_tokens,
                      windows=decode_windows(int(cache.index), max_new_tokens, cache.capacity,
                                             model.module.policy.decode_stages))
    out, _ = loop.segment(params=model.params, cache=cache, logits=logits, live=active, eos_ids=jnp.asarray(eos),
                          tables=tables, key=jax.random.key(seed))
    return out._replace(**{f: hosts.fetch_local(getattr(out, f), model.mesh) for f in out._fields if f != "steps"},
                        steps=np.asarray(out.steps))


def generate(model, tokenizer, prompts: Sequence, *, max_new_tokens: int, sampler: Sampler = Sampler(),
             stop: Sequence = (), seed: int = 0) -> list[str]:
    """Generates a completion for each prompt (a string, or a list of chat messages
    that gets the tokenizer's chat template), sampling with `sampler` (default greedy;
    `Sampler(temperature=0.7, top_p=0.9, top_k=50)`). Stops a row at EOS / <|im_end|> or
    when a stop pattern completes (the pattern's text is kept). Returns the completions,
    with special tokens removed."""
    texts = prompt_texts(tokenizer, prompts)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    out = generate_ids(model, tokenizer, ids, max_new_tokens=max_new_tokens, sampler=sampler, stop=stop, seed=seed)
    return [tokenizer.decode(out.tokens[b, : out.length[b]], skip_special_tokens=True)
            for b in range(len(texts))]
