"""Host-side parsing of a trajectory's response text: answer, confidence, format, correctness.

Everything here is plain Python on strings, on the host (the device never sees text);
the jitted reward math lives in `car_jax.calibration.rewards`.

What text these functions expect (car_jax's decision): **the response part only** -- the
model-generated tokens plus the tool observations spliced in between them, decoded with special
tokens skipped -- never the prompt. Prompts echo the tags in their instructions ("put the
answer between <answer> and </answer>"), and parsing prompt + response would pick those up.
Callers holding the full text cut the prompt off with `strip_prompt` first.

Tags are matched exactly, lowercase, without attributes: `<think>`, `<search>`, `<information>`,
`<answer>`, `<confidence>` and their closing forms.
"""
from __future__ import annotations

import dataclasses
import math
import re
import string
from typing import Sequence

from math_verify import parse, verify

TAGS = ("think", "search", "information", "answer", "confidence")
TAG_RE = re.compile(r"</?(?:%s)>" % "|".join(TAGS))  # any opening or closing tag of TAGS


def strip_prompt(full_text: str, prompt: str) -> str:
    """Returns the response part of `full_text`, which must start with `prompt`.

    Raises ValueError when it does not: guessing where a prompt ends would let echoed tags in.
    """
    if not full_text.startswith(prompt):
        raise ValueError("full_text does not start with the given prompt")
    return full_text[len(prompt):]


def last_tag_content(text: str, tag: str) -> str | None:
    """Content of the last innermost `<tag>...</tag>` pair in `text`, stripped; None if none.

    "Innermost" means the content holds no `<tag>` or `</tag>` itself: for
    `<answer>a<answer>b</answer>c</answer>` this returns "b" (and the format check fails), for
    `<answer>x` (no closing tag) it returns None, for two answers it returns the second.

    Scans from the end, so the usual answer near the end is found at once, in linear time on
    any text: the opening tag found for one closing tag is kept for the closing tags before it
    (the tags never overlap, as `tag` holds no "<"), so no stretch of text is searched twice
    for the same tag.
    """
    open_, close = f"<{tag}>", f"</{tag}>"
    end, start = text.rfind(close), len(text)
    while end != -1:
        if start >= end:  # the last opening tag before `end` is not the one we hold
            start = text.rfind(open_, 0, end)
        before = text.rfind(close, max(start, 0), end)  # the last closing tag in [start, end)
        # innermost: no other closing tag between the opening tag and `end`
        if start != -1 and before == -1:
            return text[start + len(open_):end].strip()
        end = before
    return None


# Plain decimal numbers only: ASCII digits 0-9 with an optional fractional part ("85", "85.0",
# "85.", ".5"), then an optional "%" (ASCII spaces allowed before it). No sign, no exponent, no
# nan/inf, and no other Unicode digits ("٨٥", "８５"), which `\d` and float() would take.
_CONF_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%?", re.ASCII)


def parse_confidence(text: str) -> tuple[float, bool]:
    """Reads the last `<confidence>` tag of a response: returns (q, ok) with q in [0, 1].

    Accepted (after stripping surrounding whitespace inside the tag): a plain decimal number on
    the 0..100 scale, written with the ASCII digits 0-9 -- an integer ("85"), a decimal ("85.0",
    "85.", ".5") -- optionally followed by a "%" ("85%", "85 %"). q = value / 100.
    The scale is fixed by the prompt, so "0.85" means 0.85 out of 100 (q = 0.0085); car_jax does
    not guess that the model meant 85.
    Rejected, giving (0.0, False): a missing tag or missing closing tag, an empty tag, a sign
    ("-3", "+5"), exponent notation ("1e2", "1e309"), "NaN", "inf", words, fractions, several
    numbers, digits other than ASCII 0-9 (Arabic-Indic "٨٥", fullwidth "８５"), and any value
    outside [0, 100] ("100.5", "250").
    """
    content = last_tag_content(text, "confidence")
    if content is None or _CONF_RE.fullmatch(content) is None:
        return 0.0, False
    value = float(content.rstrip("%").strip())
    if not (math.isfinite(value) and 0.0 <= value <= 100.0):
        return 0.0, False
    return value / 100.0, True


def check_format(text: str) -> tuple[bool, str]:
    """Format check of a search-agent response (the CAR format reward's condition): returns (ok, reason).

    The grammar (whitespace-only text allowed between blocks, nothing else):

        response := (think search information)* think answer confidence

    Each block is `<tag>content</tag>`; a content may hold no tag at all (nested or stray tags
    fail). The search query and the answer must be non-empty, and the confidence must parse
    (`parse_confidence`). Nothing but whitespace may follow `</confidence>`. `reason` is ""
    when ok, else a short description of the first violation.
    """
    # state -> tags allowed next; "end" allows nothing.
    allowed = {
        "start": ("think",), "think": ("search", "answer"), "search": ("information",),
        "information": ("think",), "answer": ("confidence",), "confidence": (),
    }
    state, pos, contents = "start", 0, {}
    while (m := TAG_RE.search(text, pos)) is not None:
        tag = m.group(0)
        if tag.startswith("</"):
            return False, f"unexpected {tag} at {m.start()}"
        name = tag[1:-1]
        if text[pos:m.start()].strip():
            return False, f"text outside blocks before {tag} at {m.start()}"
        if name not in allowed[state]:
            return False, f"{tag} not allowed after {state}"
        close = f"</{name}>"
        end = text.find(close, m.end())
        if end == -1:
            return False, f"{tag} at {m.start()} is not closed"
        if TAG_RE.search(text, m.end(), end):
            return False, f"nested tag inside {tag} at {m.start()}"
        contents[name] = text[m.end():end].strip()
        if name == "search" and not contents[name]:
            return False, "empty search query"
        state, pos = name, end + len(close)
    if state != "confidence":
        return False, f"response ends after {state}, expected ... answer confidence"
    if text[pos:].strip():
        return False, "text after </confidence>"
    if not contents["answer"]:
        return False, "empty answer"
    if not parse_confidence(text)[1]:
        return False, "confidence does not parse to a number in [0, 100]"
    return True, ""


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    """What the reward needs from one response: the last answer (None if no closed
    `<answer>` tag), q in [0, 1] (0.0 when the confidence failed to parse), and the checks."""

    answer: str | None
    q: float
    confidence_ok: bool
    format_ok: bool
    reason: str


def parse_response(text: str) -> ParsedResponse:
    """Parses one search-agent response (the response part only, see the module docstring)."""
    q, conf_ok = parse_confidence(text)
    ok, reason = check_format(text)
    return ParsedResponse(last_tag_content(text, "answer"), q, conf_ok, ok, reason)


# ---------------------------------------------------------------- correctness: SQuAD style
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation, drop articles a/an/the, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """True when the normalized prediction equals any normalized gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


# ---------------------------------------------------------------- correctness: math
_BOXED = "\\boxed{"
_BRACE_RE = re.compile(r"[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` whose braces balance, stripped; None if none.

    The content runs to the `}` that brings the brace depth back to that of the box's `{`.
    When the last `\\boxed{` never closes, the ones before it are tried in turn
    (`\\boxed{1} then \\boxed{2` gives "1"). Linear time in len(text): one pass over the
    braces matches each `{` to its `}` with a stack, then the boxes are tried from the last.
    """
    boxes = []  # positions of the "{" of each \boxed{, in order
    at = text.find(_BOXED)
    while at != -1:
        boxes.append(at + len(_BOXED) - 1)
        at = text.find(_BOXED, at + len(_BOXED))
    if not boxes:
        return None
    wanted, closing, open_ = set(boxes), {}, []
    for m in _BRACE_RE.finditer(text, boxes[0]):
        if m.group() == "{":
            open_.append(m.start())
        elif open_:
            i = open_.pop()
            if i in wanted:
                closing[i] = m.start()
    for i in reversed(boxes):
        if i in closing:
            return text[i + 1:closing[i]].strip()
    return None


def _as_boxed(expr: str) -> str:
    # strips $...$ delimiters so the expression can sit inside \boxed{}
    return "\\boxed{" + expr.strip().strip("$").strip() + "}"


def math_equal(prediction: str, golds: Sequence[str], timeout_seconds: int = 5) -> bool:
    """Math equivalence with math-verify: the last `\\boxed{}` of `prediction` (the whole
    prediction when it has none) against each gold answer (its last `\\boxed{}` too, or the
    whole gold string), gold first as math-verify requires.

    `timeout_seconds` goes to math-verify, which uses SIGALRM: pass 0 (no timeout) when calling
    from a thread other than the main one.
    """
    pred_expr = last_boxed(prediction)
    pred_expr = prediction if pred_expr is None else pred_expr
    if not pred_expr.strip():
        return False
    pred = parse(_as_boxed(pred_expr), parsing_timeout=timeout_seconds)
    if not pred:
        return False
    for g in golds:
        g_expr = last_boxed(g)
        gold = parse(_as_boxed(g if g_expr is None else g_expr), parsing_timeout=timeout_seconds)
        if gold and verify(gold, pred, timeout_seconds=timeout_seconds):
            return True
    return False
