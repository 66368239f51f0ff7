"""Stop detection that survives any BPE split or merge of the stop text.

A stop pattern is a sequence of strings that must appear in order in the generated
text of one segment: ("</search>",) or, for a fenced code block, ("```python", "```");
or a `Balanced` opener, which stops on the brace that closes it: `Balanced("\\boxed{")`
stops after the `}` of `\boxed{\frac{1}{2}}`, not after the first `}`.
Each pattern becomes a small automaton over *tokens*: its state is (phase, number of
characters of the phase string matched so far, KMP style), and a transition table
[Z, V] (Z states) built on the host from every token's text says where a token takes each
state, or STOP when the pattern completes anywhere inside that token. So "</search>"
split as "</", "search", ">" and "</search>\n" merged into one token both stop, and the
on-device check is one table lookup per pattern and step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

STOP = -1


@dataclasses.dataclass(frozen=True)
class Balanced:
    """Stops on the `close` character that balances the last character of `opener` (an
    `open`): after `opener` the automaton counts open minus close characters and fires
    when the count returns to 0. Depths above `max_depth` are not counted (the count
    stays at max_depth), so a nesting deeper than that stops early; math answers nest
    a few levels."""
    opener: str
    open: str = "{"
    close: str = "}"
    max_depth: int = 16

    def __post_init__(self):
        if not self.opener.endswith(self.open) or len(self.open) != 1 or len(self.close) != 1:
            raise ValueError(f"Balanced({self.opener!r}): the opener must end with the single open "
                             f"character {self.open!r}, and close must be one character")
        if self.max_depth < 1:
            raise ValueError(f"Balanced.max_depth={self.max_depth} must be >= 1")


Pattern = Union[str, Sequence[str], Balanced]


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


def _kmp_step(target: str, q: int, ch: str) -> int:
    """Characters of `target` matched after feeding `ch` with q matched (q < len(target))."""
    seen = target[:q] + ch
    for k in range(min(len(seen), len(target)), 0, -1):
        if seen.endswith(target[:k]):
            return k
    return 0


def _balanced_step(p: Balanced, state: int, text: str, kmp: dict) -> int:
    """Feeds `text` to the automaton of `p`: states 0..n-1 are characters of the opener
    matched, n-1+d is depth d (1..max_depth); returns STOP when the depth reaches 0.
    `kmp` memoizes the opener's (q, char) -> q transitions."""
    n = len(p.opener)
    for ch in text:
        if state < n:
            nxt = kmp.get((state, ch))
            if nxt is None:
                nxt = kmp[(state, ch)] = _kmp_step(p.opener, state, ch)
            state = nxt
        else:
            depth = state - n + 1 + (ch == p.open) - (ch == p.close)
            if depth == 0:
                return STOP
            state = n - 1 + min(depth, p.max_depth)
    return state


@functools.lru_cache(maxsize=16)
def _balanced_table(texts: tuple[str, ...], p: Balanced) -> np.ndarray:
    n = len(p.opener)
    n_states = n + p.max_depth
    table = np.empty((n_states, len(texts)), np.int32)
    opener_chars, braces = set(p.opener), {p.open, p.close}
    kmp: dict = {}
    for v, text in enumerate(texts):
        chars = set(text)
        for state in range(n_states):
            if state < n and not chars & opener_chars:
                table[state, v] = 0  # no character of the opener: the match restarts
            elif state >= n and not chars & braces:
                table[state, v] = state  # no brace: the depth stays
            else:
                table[state, v] = _balanced_step(p, state, text, kmp)
    return table


def stop_tables(tokenizer, patterns: Sequence[Pattern]) -> np.ndarray:
    """int32[A, Z, V] transition tables, one automaton per pattern (A), over the most
    states any pattern has (Z; padded states unused)."""
    texts = tuple(token_texts(tokenizer))
    tables = []
    for pattern in patterns:
        if isinstance(pattern, Balanced):
            tables.append(_balanced_table(texts, pattern))
            continue
        phases = (pattern,) if isinstance(pattern, str) else tuple(pattern)
        if not phases or any(not s for s in phases):
            raise ValueError(f"stop pattern {phases!r} is empty; give non-empty strings")
        tables.append(_table(texts, phases))
    if not tables:  # one automaton that never fires keeps the shapes non-empty
        return np.zeros((1, 1, len(texts)), np.int32)
    width = max(t.shape[0] for t in tables)
    out = np.zeros((len(tables), width, len(texts)), np.int32)
    for i, t in enumerate(tables):
        out[i, : t.shape[0]] = t
    return out


def matches(text: str, pattern: Pattern) -> bool:
    """Host-side reference: does `text` contain the pattern's strings in order (for
    `Balanced`: the opener and then the close character that balances it, depths capped
    at max_depth as in the automaton)?"""
    if isinstance(pattern, Balanced):
        start = text.find(pattern.opener)
        if start < 0:
            return False
        depth = 1
        for ch in text[start + len(pattern.opener):]:
            depth = min(depth + (ch == pattern.open) - (ch == pattern.close), pattern.max_depth)
            if depth == 0:
                return True
        return False
    pos = 0
    for s in (pattern,) if isinstance(pattern, str) else pattern:
        hit = text.find(s, pos)
        if hit < 0:
            return False
        pos = hit + len(s)
    return True
