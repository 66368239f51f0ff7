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
Qwen (both tools, native tool calls of Qwen2.5 / Qwen3 Instruct): a `<tool_call>` holding
JSON `{"name": .., "arguments": {..}}` (`data.chat_tools`), its result spliced in the chat
layout those models were trained on (the assistant turn closed, a user turn holding a
`<tool_response>`, a new assistant turn opened); the answer as in `Mixed`.

An observation is `head + body + tail` (`wrap`): the episode loop truncates the body (the
tool's result) to the observation budget and keeps the wrapper whole, so a long result never
costs the closing tag.
"""
from __future__ import annotations

import dataclasses
import re

from car_jax.data.chat_tools import read_call
from car_jax.rollout.stops import Balanced

ANSWER, INVALID, VOID = "answer", "invalid", "void"


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # ANSWER, INVALID, VOID, or a tool name ("search", "code")
    payload: str = ""


class _Wrapped:
    """What every protocol shares: an observation is its `wrap` joined, no observation
    ends an episode unless the protocol says otherwise (TIR's printed answer), and the
    reward checks a QA response's format by the tag chain unless the protocol names
    another grammar (`calibration.pieces.GRAMMARS`)."""
    grammar = "tags"

    def wrap(self, action: Action, result: str) -> tuple[str, str, str]:
        raise NotImplementedError

    def observation(self, action: Action, result: str) -> str:
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation: str) -> bool:
        """Only the model's answer ends an episode."""
        return False


@dataclasses.dataclass(frozen=True)
class SearchR1(_Wrapped):
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



def car_search() -> SearchR1:
    """Search-R1 actions for CAR: the answer is followed by `<confidence>n</confidence>`,
    so a segment holding the answer runs on to the end of the confidence tag."""
    return SearchR1(stops=("</search>", "</confidence>"), final_stops=("</confidence>",))


@dataclasses.dataclass(frozen=True)
class TIR(_Wrapped):
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

    def ends_episode(self, observation: str) -> bool:
        """A boxed answer printed by the program (`final_answer`) is the episode's answer."""
        return "\\boxed{" in observation


@dataclasses.dataclass(frozen=True)
class Mixed(_Wrapped):
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



# Qwen's chat layout around a spliced observation: the assistant turn ends, a user turn
# holds it, the next assistant turn opens (what the chat template renders for a tool message)
END_TURN, USER_TURN, ASSISTANT_TURN = "<|im_end|>\n", "<|im_start|>user\n", "<|im_start|>assistant\n"


@dataclasses.dataclass(frozen=True)
class Qwen(_Wrapped):
    """Native tool calls (Qwen2.5 / Qwen3 Instruct; the prompt lists the tools through the
    chat template, `data.chat_tools.tool_prompts`). The first complete `<tool_call>` or
    `<answer>` in the segment decides: a call is JSON `{"name": "search", "arguments":
    {"query": ..}}` or `{"name": "python", "arguments": {"code": ..}}` (`read_call`), one
    call a turn (the segment stops at its `</tool_call>`); the answer runs on to
    `</confidence>` as in `Mixed`. Anything else (malformed JSON, an unknown function, wrong
    arguments, prose) is invalid. A tool's result comes back as the chat template renders a
    tool message, `<|im_end|>` `<|im_start|>user` `<tool_response>` result `</tool_response>`
    `<|im_end|>` `<|im_start|>assistant`; the invalid message as a plain user turn. No
    observation ends the episode. A turn the model ended with its own `<|im_end|>` (prose,
    no call) keeps that token, so the message's turn follows a second one: `wrap` is not
    told how the segment ended. The reward checks the format by Qwen's turns (`grammar`)."""
    grammar = "qwen"
    stops: tuple = ("</tool_call>", "</confidence>")
    final_stops: tuple = ("</confidence>",)
    # no literal tags in the message (see SearchR1.invalid_message)
    invalid_message: str = ("That was not a valid action. Call one of the listed tools with a JSON object of its "
                            "name and its arguments, as the tool list describes, or give the final answer between "
                            "the answer tags followed by your confidence.")
    _tags = re.compile(r"<(tool_call|answer)>(.*?)</\1>", re.DOTALL)

    def parse(self, text: str) -> Action:
        m = self._tags.search(text)
        if m is None:
            return Action(INVALID)
        if m.group(1) == "answer":
            return Action(ANSWER, m.group(2).strip())
        call = read_call(m.group(2))
        return Action(INVALID) if call is None else Action(*call)

    def wrap(self, action: Action, result: str) -> tuple[str, str, str]:
        """(head, body, tail): a tool's result in a `<tool_response>` of a user turn, the
        invalid message as a user turn of its own."""
        if action.kind == INVALID:
            return END_TURN + USER_TURN, self.invalid_message, END_TURN + ASSISTANT_TURN
        return (END_TURN + USER_TURN + "<tool_response>\n", result.strip(),
                "\n</tool_response>" + END_TURN + ASSISTANT_TURN)



# the config names of the protocols (`rollout.protocol`) -> (factory, the tool kind it calls;
# "mixed": both, `toolbox.tool_names`)
PROTOCOLS = {"car_search": (car_search, "search"), "search_r1": (SearchR1, "search"), "tir": (TIR, "code"),
             "mixed": (Mixed, "mixed"), "qwen": (Qwen, "mixed")}
