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


def _kmp_step(target: str, q: int, ch: str) -> int:
    """Characters of `target` matched after feeding `ch` with q matched (q < len(target))."""
    seen = target[:q] + ch
    for k in range(min(len(seen), len(target)), 0, -1):
        if seen.endswith(target[:k]):
            return k
    return 0


def _char_step(pattern: tuple[str, ...] | Balanced, ch: str) -> np.ndarray:
    """int32[Z + 1]: where the character `ch` takes each state of the pattern's automaton;
    entry Z stands for STOP, which nothing leaves.

    Strings in order: state offset(phase) + q, q characters of the phase's string matched
    (KMP); completing a phase moves to the next one's q = 0, completing the last stops.
    Balanced: states 0..n-1 are characters of the opener matched, n-1+d is depth d
    (1..max_depth); depth 0 stops."""
    if isinstance(pattern, Balanced):
        n = len(pattern.opener)
        out = np.empty(n + pattern.max_depth + 1, np.int32)
        for q in range(n):
            out[q] = _kmp_step(pattern.opener, q, ch)  # q = n (the opener's "{") is depth 1
        for depth in range(1, pattern.max_depth + 1):
            d = depth + (ch == pattern.open) - (ch == pattern.close)
            out[n - 1 + depth] = len(out) - 1 if d == 0 else n - 1 + min(d, pattern.max_depth)
    else:
        out = np.empty(sum(len(t) for t in pattern) + 1, np.int32)
        state = 0
        for target in pattern:
            for q in range(len(target)):
                nxt = _kmp_step(target, q, ch)
                out[state + q] = state + nxt  # nxt == len(target): the next phase's q = 0 (or STOP)
            state += len(target)
    out[-1] = len(out) - 1
    return out


@functools.lru_cache(maxsize=4)
def _char_codes(texts: tuple[str, ...]) -> tuple[str, np.ndarray]:
    """(the distinct characters of the vocabulary, int32[V, W] each token's characters as
    indices into them, -1 past the token's end; W the longest token)."""
    alphabet = "".join(sorted(set("".join(texts))))
    index = {c: i for i, c in enumerate(alphabet)}
    codes = np.full((len(texts), max(1, max(map(len, texts)))), -1, np.int32)
    for v, text in enumerate(texts):
        codes[v, : len(text)] = [index[c] for c in text]
    return alphabet, codes


@functools.lru_cache(maxsize=16)
def _table(texts: tuple[str, ...], pattern: tuple[str, ...] | Balanced) -> np.ndarray:
    """int32[Z, V]: the state each token's text leads each state to (STOP: the pattern
    completed inside the token). Every token and state advances at once, one character
    position at a time, through a [characters, states] table."""
    alphabet, codes = _char_codes(texts)
    inert = _char_step(pattern, "\0")  # any character the pattern does not use
    used = set("".join(pattern) if isinstance(pattern, tuple) else pattern.opener + pattern.close)
    step = np.tile(inert, (len(alphabet), 1))  # [C, Z + 1]
    for i, c in enumerate(alphabet):
        if c in used:
            step[i] = _char_step(pattern, c)
    n_states = len(inert) - 1
    state = np.tile(np.arange(n_states, dtype=np.int32), (len(texts), 1))  # [V, Z]
    for j in range(codes.shape[1]):
        rows = np.flatnonzero(codes[:, j] >= 0)
        state[rows] = step[codes[rows, j][:, None], state[rows]]
    return np.where(state == n_states, STOP, state).T.astype(np.int32)


def stop_tables(tokenizer, patterns: Sequence[Pattern]) -> np.ndarray:
    """int32[A, Z, V] transition tables, one automaton per pattern (A), over the most
    states any pattern has (Z; padded states unused)."""
    texts = tuple(token_texts(tokenizer))
    tables = []
    for pattern in patterns:
        if not isinstance(pattern, Balanced):
            pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
            if not pattern or any(not s for s in pattern):
                raise ValueError(f"stop pattern {pattern!r} is empty; give non-empty strings")
        tables.append(_table(texts, pattern))
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
