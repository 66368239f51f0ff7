"""Action protocols: how a segment of model text becomes an action, and how a tool's
result is written back as an observation. Host-side string handling only.

SearchR1 (evidence tool): the first `<search>q</search>` or `<answer>a</answer>` in the
segment decides; anything else is an invalid action, answered with a fixed message.
TIR (verification tool, SimpleTIR style): a `\\boxed{` ends the episode (when the model
writes it, at its balanced closing brace; when the program prints it with `final_answer`, at
that observation); else the first fenced Python block is run; a turn with neither is *void*.
Mixed (both tools, beyond the paper): SearchR1's tags and TIR's fenced Python blocks in one
episode; the first complete action in the segment decides (a search, a code block, or the
`<answer>`, which runs on to `</confidence>` as in `car_search`); anything else is invalid.

An observation is `head + body + tail` (`wrap`): the episode loop truncates the body (the
tool's result) to the observation budget and keeps the wrapper whole, so a long result never
costs the closing tag.
"""
from __future__ import annotations

import dataclasses
import re

from car_jax.rollout.stops import Balanced

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

    def wrap(self, action: Action, result: str) -> tuple[str, str, str]:
        """(head, body, tail) of the observation for `action`'s tool `result`."""
        if action.kind == INVALID:
            return "", self.invalid_message, ""
        return "\n\n<information>", result.strip(), "</information>\n\n"

    def observation(self, action: Action, result: str) -> str:
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation: str) -> bool:
        """Search observations never end an episode (only the model's answer does)."""
        return False


def car_search() -> SearchR1:
    """Search-R1 actions for CAR: the answer is followed by `<confidence>n</confidence>`,
    so a segment holding the answer runs on to the end of the confidence tag."""
    return SearchR1(stops=("</search>", "</confidence>"), final_stops=("</confidence>",))


@dataclasses.dataclass(frozen=True)
class TIR:
    """Fenced Python blocks run by the code tool; `\\boxed{...}` is the final answer. A
    segment holding the answer stops at the brace that closes `\\boxed{` (nested braces,
    as in `\\boxed{\\frac{1}{2}}`, are counted); a `\\boxed{` that the program prints
    (`final_answer`) ends the episode after that observation."""
    stops: tuple = (("```python", "```"), Balanced("\\boxed{"))
    final_stops: tuple = (Balanced("\\boxed{"),)
    _code = re.compile(r"```python\n?(.*?)```", re.DOTALL)

    def parse(self, text: str) -> Action:
        if "\\boxed{" in text:
            return Action(ANSWER)
        m = self._code.search(text)
        return Action("code", m.group(1)) if m else Action(VOID)

    def wrap(self, action: Action, result: str) -> tuple[str, str, str]:
        """(head, body, tail); a void turn has no observation."""
        if action.kind == VOID:
            return "", "", ""
        # the code tool already formats "Code execution result: <stdout>" (512 chars max)
        return "\n```output\n", result, "\n```\n"

    def observation(self, action: Action, result: str) -> str:
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation: str) -> bool:
        """A boxed answer printed by the program (`final_answer`) is the episode's answer."""
        return "\\boxed{" in observation


@dataclasses.dataclass(frozen=True)
class Mixed:
    """Both tools in one episode: `<search>q</search>` (an `<information>` observation, as
    SearchR1) and a fenced ```python block (an ```output observation, as TIR); the answer is
    `<answer>a</answer>` followed by `<confidence>n</confidence>` (car_search's layout, for
    math problems too: the reward reads the last `<answer>` of either task). Of the actions
    written in a segment, the one that starts first decides; a segment with none complete
    (a tag or a fence left open, prose only, an unknown tag) is an invalid action, answered
    with a message that names both tools. No observation ends the episode: a `\\boxed{}`
    that a program prints is output like any other, the answer is the model's own."""
    stops: tuple = ("</search>", ("```python", "```"), "</confidence>")
    final_stops: tuple = ("</confidence>",)
    # no literal tags or fences in the message (see SearchR1.invalid_message)
    invalid_message: str = ("\nThat was not a valid action. Write a search query between the search tags to look "
                            "up a fact, a Python program in a python code block to calculate, or the final answer "
                            "between the answer tags followed by your confidence.\n")
    _tags = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

    def parse(self, text: str) -> Action:
        found = []
        tag, code = self._tags.search(text), TIR._code.search(text)
        if tag is not None:
            found.append((tag.start(), Action("search" if tag.group(1) == "search" else ANSWER, tag.group(2).strip())))
        if code is not None:
            found.append((code.start(), Action("code", code.group(1))))
        return min(found, key=lambda f: f[0])[1] if found else Action(INVALID)

    def wrap(self, action: Action, result: str) -> tuple[str, str, str]:
        """(head, body, tail): TIR's for code, SearchR1's for a search, the message for an invalid action."""
        if action.kind == INVALID:
            return "", self.invalid_message, ""
        return (TIR() if action.kind == "code" else SearchR1()).wrap(action, result)

    def observation(self, action: Action, result: str) -> str:
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation: str) -> bool:
        """Only the model's answer ends a mixed episode (see the class doc)."""
        return False


# the config names of the protocols (`rollout.protocol`) -> (factory, the tool kind it calls;
# "mixed": both, `toolbox.tool_names`)
PROTOCOLS = {"car_search": (car_search, "search"), "search_r1": (SearchR1, "search"), "tir": (TIR, "code"),
             "mixed": (Mixed, "mixed")}
