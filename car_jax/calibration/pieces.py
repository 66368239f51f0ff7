"""Parsing a response that the model and its tools wrote together.

An episode's response interleaves text the model sampled with tool observations spliced in
between (`rollout.episode.Trajectory.pieces`: (text, written by the model) pairs, in order).
Only the model's own pieces can give an answer or a confidence: a retrieved document holding
`<answer>X</answer><confidence>99</confidence>` must neither earn a confident answer the
model never gave nor cost a real answer the format penalty. So:

- answer and confidence are read from the model's pieces alone (`model_text`);
- the format chain is checked on `format_text`: the model's pieces as written, and each
  tool piece reduced to its wrapper (`<information></information>` for a search result,
  the tool's text without tags otherwise), so a tool's content cannot add or break a block;
  a model that writes an `<information>` tag itself fails the format (only the tool
  writes observations);
- for math, the boxed answer is the model's last `\\boxed{}`, else the last one its
  program printed (`final_answer`): a program's output is the model's doing.

A plain string is one response of unknown origin and is parsed whole (`parsing.parse_response`),
as before pieces existed: the SFT demonstrations, notebooks and single-turn generations.

Two format grammars (GRAMMARS): "tags", the Search-R1 tag chain (`parsing.check_format`), and
"qwen", Qwen's native tool-call layout (`chat_format.check_chat_turns`: the model's turns,
split at each tool result; a tool piece that is not a `<tool_response>` is the protocol's
answer to an invalid call, and fails the format as an invalid action fails the tag chain).
"""
from __future__ import annotations

import re
from typing import Sequence, Union

from car_jax.calibration import chat_format, parsing

Piece = tuple[str, bool]  # (text, written by the model)
Response = Union[str, Sequence[Piece]]

GRAMMARS = ("tags", "qwen")  # the format grammars: the Search-R1 tag chain, Qwen's tool calls
_WRAPPED = re.compile(r"^(\s*<information>).*(</information>\s*)$", re.DOTALL)


def model_text(pieces: Sequence[Piece]) -> str:
    """The model's own text: its pieces joined, the tools' left out."""
    return "".join(text for text, by_model in pieces if by_model)


def tool_text(pieces: Sequence[Piece]) -> str:
    return "".join(text for text, by_model in pieces if not by_model)


def _skeleton(text: str) -> str:
    wrapped = _WRAPPED.match(text)
    return wrapped.group(1) + wrapped.group(2) if wrapped else parsing.TAG_RE.sub("", text)


def format_text(pieces: Sequence[Piece]) -> str:
    """The response with every tool piece reduced to its wrapper (see the module docstring)."""
    return "".join(text if by_model else _skeleton(text) for text, by_model in pieces)


def chat_turns(pieces: Sequence[Piece]) -> tuple[list[str], int | None]:
    """Pieces in Qwen's layout -> (the model's turns, split at each tool piece; the 1-based
    turn after which the tool answered an invalid call, or None when every tool piece is a
    `<tool_response>`)."""
    turns, invalid = [""], None
    for text, by_model in pieces:
        if by_model:
            turns[-1] += text
            continue
        if invalid is None and not chat_format.RESULT_RE.search(text):
            invalid = len(turns)
        turns.append("")
    return turns, invalid


def _format(response: Response, grammar: str) -> tuple[bool, str]:
    """(ok, reason) of the format check of `grammar` (see the module docstring)."""
    if grammar == "tags":
        text = response if isinstance(response, str) else format_text(response)
        return parsing.check_format(text)
    if grammar != "qwen":
        raise ValueError(f"unknown format grammar {grammar!r}: choose one of {GRAMMARS}")
    if isinstance(response, str):
        return chat_format.check_chat_turns(chat_format.split_turns(response))
    turns, invalid = chat_turns(response)
    if invalid is not None:
        return False, f"turn {invalid}: not a valid tool call (the protocol answered with its message)"
    return chat_format.check_chat_turns(turns)


def parse_pieces(response: Response, grammar: str = "tags") -> parsing.ParsedResponse:
    """Answer, confidence and format of one response (pieces, or a plain string parsed whole),
    the format by `grammar` ("tags" or "qwen", GRAMMARS)."""
    own = response if isinstance(response, str) else model_text(response)
    q, conf_ok = parsing.parse_confidence(own)
    ok, reason = _format(response, grammar)
    if ok and grammar == "tags" and not isinstance(response, str) and re.search(r"</?information>", own):
        ok, reason = False, "the model wrote an <information> tag (only the search tool writes observations)"
    return parsing.ParsedResponse(parsing.last_tag_content(own, "answer"), q, conf_ok, ok, reason)


def boxed_source(response: Response) -> str:
    """The text a math answer is read from: the model's text when it holds a `\\boxed{}`,
    else the tools' text (a program's `final_answer`); a plain string as it is."""
    if isinstance(response, str):
        return response
    own = model_text(response)
    return own if parsing.last_boxed(own) is not None else tool_text(response)
