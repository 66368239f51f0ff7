"""Stop detection that survives any BPE split or merge of the stop text.

A stop pattern is a sequence of strings that must appear in order in the generated
text of one segment: ("</search>",) or, for a fenced code block, ("```python", "```").
Each pattern becomes a small automaton over *tokens*: its state is (phase, number of
characters of the phase string matched so far, KMP style), and a transition table
[Z, V] (Z states) built on the host from every token's text says where a token takes each
state, or STOP when the pattern completes anywhere inside that token. So "</search>"
split as "</", "search", ">" and "</search>\n" merged into one token both stop, and the
on-device check is one table lookup per pattern and step.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

STOP = -1


def token_texts(tokenizer) -> list[str]:
    """The text of every vocabulary id, as it appears inside a decoded string.

    Byte-level BPE tokens are mapped back to bytes (decoded with errors="replace", so a
    token holding half a UTF-8 character shows a replacement char); other vocabularies
    use `decode([id])`."""
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values()) + 1)
    by_id = [""] * size
    for tok, i in vocab.items():
        by_id[i] = tok
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = set(getattr(tokenizer, "all_special_tokens", []))
    added = set(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else set()
    plain = [t for t in by_id if t and t not in special and t not in added]
    if plain and all(set(t) <= byte_of.keys() for t in plain[:2000]):
        return [t if (t in special or t in added or not set(t) <= byte_of.keys())
                else bytes(byte_of[c] for c in t).decode("utf-8", errors="replace") for t in by_id]
    return [tokenizer.decode([i]) for i in range(size)]


def _advance(text: str, phases: Sequence[str], phase: int, q: int) -> tuple[int, int] | None:
    """Feeds `text` to the automaton in (phase, q); None when the pattern completes."""
    while True:
        target = phases[phase]
        seen = target[:q] + text
        hit = seen.find(target)
        if hit < 0:
            # longest suffix of `seen` that is a proper prefix of `target`
            for k in range(min(len(target) - 1, len(seen)), -1, -1):
                if k == 0 or seen.endswith(target[:k]):
                    return phase, k
        phase += 1
        if phase == len(phases):
            return None
        text, q = seen[hit + len(target):], 0


@functools.lru_cache(maxsize=16)
def _table(texts: tuple[str, ...], phases: tuple[str, ...]) -> np.ndarray:
    offsets = np.cumsum([0] + [len(p) for p in phases])
    n_states = int(offsets[-1])
    table = np.empty((n_states, len(texts)), np.int32)
    char_sets = [set(t) for t in texts]
    for phase, target in enumerate(phases):
        chars = set(target)
        for q in range(len(target)):
            state = offsets[phase] + q
            for v, text in enumerate(texts):
                if q == 0 and not (chars & char_sets[v]):  # shares no character: stays put
                    table[state, v] = state
                    continue
                nxt = _advance(text, phases, phase, q)
                table[state, v] = STOP if nxt is None else offsets[nxt[0]] + nxt[1]
    return table


def stop_tables(tokenizer, patterns: Sequence[Sequence[str] | str]) -> np.ndarray:
    """int32[A, Z, V] transition tables, one automaton per pattern (A), over the most
    states any pattern has (Z; padded states unused)."""
    texts = tuple(token_texts(tokenizer))
    phases = [(p,) if isinstance(p, str) else tuple(p) for p in patterns]
    for p in phases:
        if not p or any(not s for s in p):
            raise ValueError(f"stop pattern {p!r} is empty; give non-empty strings")
    tables = [_table(texts, p) for p in phases]
    if not tables:  # one automaton that never fires keeps the shapes non-empty
        return np.zeros((1, 1, len(texts)), np.int32)
    width = max(t.shape[0] for t in tables)
    out = np.zeros((len(tables), width, len(texts)), np.int32)
    for i, t in enumerate(tables):
        out[i, : t.shape[0]] = t
    return out


def matches(text: str, pattern: Sequence[str] | str) -> bool:
    """Host-side reference: does `text` contain the pattern's strings in order?"""
    pos = 0
    for s in (pattern,) if isinstance(pattern, str) else pattern:
        hit = text.find(s, pos)
        if hit < 0:
            return False
        pos = hit + len(s)
    return True
