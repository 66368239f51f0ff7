"""Action protocols: how a segment of model text becomes an action, and how a tool's
result is written back as an observation. Host-side string handling only.

SearchR1 (evidence tool): the first `<search>q</search>` or `<answer>a</answer>` in the
segment decides; anything else is an invalid action, answered with a fixed message.
TIR (verification tool, SimpleTIR style): a `\\boxed{` ends the episode; else the first
fenced Python block is run; a turn with neither is *void*.
"""
from __future__ import annotations

import dataclasses
import re

ANSWER, INVALID, VOID = "answer", "invalid", "void"


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # ANSWER, INVALID, VOID, or a tool name ("search", "code")
    payload: str = ""


@dataclasses.dataclass(frozen=True)
class SearchR1:
    """`<search>` / `<answer>` tags; observations in `<information>` blocks."""
    stops: tuple = ("</search>", "</answer>")
    final_stops: tuple = ("</answer>",)  # the answer-only last turn
    # no literal tags in the message: it is spliced into the response, and tags there
    # would be parsed as the model's own (an empty answer or query)
    invalid_message: str = ("\nThat was not a valid action. Write a search query between the search tags, "
                            "or the final answer between the answer tags.\n")
    _pattern = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

    def parse(self, text: str) -> Action:
        m = self._pattern.search(text)
        if m is None:
            return Action(INVALID)
        return Action("search" if m.group(1) == "search" else ANSWER, m.group(2).strip())

    def observation(self, action: Action, result: str) -> str:
        if action.kind == INVALID:
            return self.invalid_message
        return f"\n\n<information>{result.strip()}</information>\n\n"


def car_search() -> SearchR1:
    """Search-R1 actions for CAR: the answer is followed by `<confidence>n</confidence>`,
    so a segment holding the answer runs on to the end of the confidence tag."""
    return SearchR1(stops=("</search>", "</confidence>"), final_stops=("</confidence>",))


@dataclasses.dataclass(frozen=True)
class TIR:
    """Fenced Python blocks run by the code tool; `\\boxed{...}` is the final answer.
    The stop for an answer is the first `}` after `\\boxed{`: a nested brace ends the
    segment early, and the answer text is still read from the full trajectory."""
    stops: tuple = (("```python", "```"), ("\\boxed{", "}"))
    final_stops: tuple = (("\\boxed{", "}"),)
    _code = re.compile(r"```python\n?(.*?)```", re.DOTALL)

    def parse(self, text: str) -> Action:
        if "\\boxed{" in text:
            return Action(ANSWER)
        m = self._code.search(text)
        return Action("code", m.group(1)) if m else Action(VOID)

    def observation(self, action: Action, result: str) -> str:
        if action.kind == VOID:
            return ""
        # the code tool already formats "Code execution result: <stdout>" (512 chars max)
        return f"\n```output\n{result}\n```\n"


# the config names of the protocols (`rollout.protocol`) -> (factory, the tool kind it calls)
PROTOCOLS = {"car_search": (car_search, "search"), "search_r1": (SearchR1, "search"), "tir": (TIR, "code")}
