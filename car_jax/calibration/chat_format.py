"""The format check of a response in Qwen's native tool-call layout (`rollout.protocol=qwen`),
the counterpart of `parsing.check_format` for the Search-R1 tags.

A response is a list of the model's turns, split where a tool's result came back (a
`<tool_response>` block in a user turn). The grammar, per turn (whitespace aside):

    every turn but the last := prose? <tool_call>call</tool_call>
    the last turn           := prose? <answer>a</answer> <confidence>n</confidence>

Prose is free text the model writes before acting (a `<think>` block included); it may
hold no tag of CHAT_TAGS. A call and an answer must be non-empty and the confidence must
parse (`parsing.parse_confidence`); nothing but whitespace may follow `</tool_call>` or
`</confidence>`, or stand between `</answer>` and `<confidence>`. The Search-R1 tags
(`<search>`, `<information>`) have no place here, and only the tool writes
`<tool_response>`. Whether a call's JSON names a real tool is the protocol's decision
(`rollout.protocols.Qwen`): an invalid call gets a message instead of a result, and the
caller that holds the episode's pieces fails the format for it (`pieces.parse_pieces`).
"""
from __future__ import annotations

import re
from typing import Sequence

from car_jax.calibration.parsing import parse_confidence

CHAT_TAGS = ("tool_call", "tool_response", "answer", "confidence", "search", "information")
CHAT_TAG_RE = re.compile(r"</?(?:%s)>" % "|".join(CHAT_TAGS))
# a tool's result as the protocol writes it back (its turn markers are special tokens, which a
# decoded response may or may not keep)
RESULT_RE = re.compile(r"(?:<\|im_end\|>)?\s*(?:<\|im_start\|>user)?\s*<tool_response>.*?</tool_response>"
                       r"\s*(?:<\|im_end\|>)?\s*(?:<\|im_start\|>assistant\n)?", re.DOTALL)
_TURN_MARK = re.compile(r"<\|im_(?:start|end)\|>(?:assistant|user)?")


def split_turns(text: str) -> list[str]:
    """A response read whole (no pieces: unknown origin) -> the model's turns, split at each
    `<tool_response>` block and the turn markers around it."""
    return RESULT_RE.split(text)


def _blocks(turn: str) -> tuple[list[tuple[str, str, str]], str]:
    """A turn -> ([(prose before, tag name, content)] of its top-level blocks, text after the
    last block); raises ValueError on a stray closing tag, an unclosed or a nested tag."""
    blocks, pos = [], 0
    while (m := CHAT_TAG_RE.search(turn, pos)) is not None:
        tag = m.group(0)
        if tag.startswith("</"):
            raise ValueError(f"unexpected {tag}")
        name = tag[1:-1]
        end = turn.find(f"</{name}>", m.end())
        if end == -1:
            raise ValueError(f"{tag} is not closed")
        if CHAT_TAG_RE.search(turn, m.end(), end):
            raise ValueError(f"nested tag inside {tag}")
        blocks.append((turn[pos:m.start()], name, turn[m.end():end].strip()))
        pos = end + len(name) + 3
    return blocks, turn[pos:]


def check_chat_turns(turns: Sequence[str]) -> tuple[bool, str]:
    """The model's turns (each the text it wrote between two tool results) -> (ok, reason),
    by the grammar of the module docstring; `reason` is "" when ok, else the first violation
    and the turn (1-based) it is in."""
    if not turns:
        return False, "no turn"
    for k, raw in enumerate(turns, 1):
        turn = _TURN_MARK.sub("", raw)
        try:
            blocks, after = _blocks(turn)
        except ValueError as e:
            return False, f"turn {k}: {e}"
        names = [name for _, name, _ in blocks]
        last = k == len(turns)
        want = ["answer", "confidence"] if last else ["tool_call"]
        if names != want:
            got = " ".join(names) or "no tag"
            return False, f"turn {k}: {got}, expected {' '.join(want)}" + ("" if last else " (one call a turn)")
        if after.strip():
            return False, f"turn {k}: text after </{want[-1]}>"
        if not blocks[0][2]:
            return False, f"turn {k}: empty {want[0]}"
        if last and blocks[1][0].strip():
            return False, f"turn {k}: text between </answer> and <confidence>"
    if not parse_confidence(turns[-1])[1]:
        return False, "confidence does not parse to a number in [0, 100]"
    return True, ""
