"""Prompt templates: plain strings, so they can be read (and copied) as they are.

Each template is a system message (the rules) and a user message (`{question}` filled in).
`make_prompt(example, "search" | "direct" | "tir" | "mixed" | "qwen" | "chance" | PromptTemplate) -> [system, user]`
chat messages for `run_episodes`.

The layouts match what the parsers check (`car_jax.calibration.parsing.check_format`):
    search  <think>..</think> (<search>q</search> <information>..</information> <think>..</think>)*
            <answer>a</answer> <confidence>n</confidence>
    direct  <think>..</think> <answer>a</answer> <confidence>n</confidence>
    tir     prose and ```python blocks (results come back in ```output blocks), then
            <confidence>n</confidence> and the final \\boxed{answer} as the very last thing:
            the TIR protocol ends the episode at the boxed answer, so the confidence comes first.
    mixed   both tools (the `Mixed` protocol): <think>..</think>, then any number of
            <search>q</search> <information>..</information> or ```python blocks ```output blocks,
            each followed by <think>..</think>, then <answer>a</answer> <confidence>n</confidence>.
            A search question's trajectory is scored on the search layout (a code block there
            fails the format check); an arithmetic problem's needs only the confidence to parse.
    qwen    native tool calls (the `qwen` protocol): the template's own tool layout, the tools
            listed by the tokenizer's chat template (`chat_tools.tool_prompts`, `tools=`); calls
            as <tool_call>{"name": .., "arguments": {..}}</tool_call>, results in
            <tool_response> blocks of a user turn, then <answer>a</answer> <confidence>n</confidence>.
            The system message holds CAR's answer and confidence rules only; `check_format`
            (Search-R1's grammar) does not read this layout.
    chance  the positive control (`car_jax.data.chance`): <answer>the coin's kind</answer>
            <confidence>n</confidence>, one segment, no tool; the confidence is all there is to learn.
"""
from __future__ import annotations

import dataclasses

SEARCH_SYSTEM = """\
You answer questions with the help of a search engine. Work in this order:
1. Think first, inside <think> and </think>.
2. If you are missing a fact, search for it by writing a query inside <search> and </search>. \
The results will appear between <information> and </information>. Think again about what they say. \
You may search several times.
3. When you are ready, give a short final answer (a few words, no explanation) inside <answer> and </answer>.
4. Right after the answer, rate how likely your answer is to be correct as a whole number from 0 \
(surely wrong) to 100 (surely right), inside <confidence> and </confidence>. Be honest: if the \
search results did not contain the answer, your confidence should be low.
Write nothing after </confidence>.
Example of the layout:
<think> I need the founding year of the town. </think>
<search> town founding year </search>
<information> ... </information>
<think> The second result gives the year. </think>
<answer> 1650 </answer>
<confidence> 90 </confidence>"""

DIRECT_SYSTEM = """\
You answer questions from your own knowledge; no tools are available. Work in this order:
1. Think first, inside <think> and </think>.
2. Give a short final answer (a few words, no explanation) inside <answer> and </answer>.
3. Right after the answer, rate how likely your answer is to be correct as a whole number from 0 \
(surely wrong) to 100 (surely right), inside <confidence> and </confidence>. Be honest: if you \
are guessing, your confidence should be low.
Write nothing after </confidence>.
Example of the layout:
<think> I recall the capital of this country. </think>
<answer> Paris </answer>
<confidence> 85 </confidence>"""

TIR_SYSTEM = """\
You solve math problems and may run Python to check your work. To run code, write a block that \
starts with ```python and ends with ```; its printed output comes back to you in an ```output block. \
Inside the code, final_answer(x) prints x as the boxed answer. When you are done:
1. Rate how likely your answer is to be correct as a whole number from 0 (surely wrong) to 100 \
(surely right), inside <confidence> and </confidence>.
2. Then write the final answer as \\boxed{answer}. This must be the last thing you write.
Example of the ending:
<confidence> 80 </confidence>
\\boxed{42}"""

MIXED_SYSTEM = """\
You answer questions with the help of two tools: a search engine that finds facts, and a Python \
interpreter that calculates. Work in this order:
1. Think first, inside <think> and </think>.
2. If you are missing a fact, search for it by writing a query inside <search> and </search>. \
The results will appear between <information> and </information>.
3. If you need to calculate, write a Python program in a block that starts with ```python and ends \
with ```, and print the result. What it prints comes back to you in an ```output block.
4. Search for facts you do not know; calculate with the numbers you have. After each result, think \
again inside <think> and </think>. You may use the tools several times.
5. When you are ready, give a short final answer (a few words or a number, no explanation) inside \
<answer> and </answer>.
6. Right after the answer, rate how likely your answer is to be correct as a whole number from 0 \
(surely wrong) to 100 (surely right), inside <confidence> and </confidence>. Be honest: if the \
search results did not contain the answer or the program failed, your confidence should be low.
Write nothing after </confidence>.
Example of a question that needs a fact:
<think> I need the founding year of the town. </think>
<search> town founding year </search>
<information> ... </information>
<think> The second result gives the year. </think>
<answer> 1650 </answer>
<confidence> 90 </confidence>
Example of a problem that needs a calculation:
<think> I should add the three lengths. </think>
```python
print(412 + 96 + 1250)
```
```output
Code execution result: 1758
```
<think> The program gives the total. </think>
<answer> 1758 </answer>
<confidence> 95 </confidence>"""

# the tools and their call format come from the chat template (`tools=`), which lists them after this text
QWEN_SYSTEM = """\
You answer questions with the help of the tools listed below: search finds facts, python calculates. \
Call a tool when you are missing a fact or need a calculation, one call at a time; its result comes \
back to you. You may call the tools several times.
When you are ready, give a short final answer (a few words or a number, no explanation) inside \
<answer> and </answer>.
Right after the answer, rate how likely your answer is to be correct as a whole number from 0 \
(surely wrong) to 100 (surely right), inside <confidence> and </confidence>. Be honest: if the \
search results did not contain the answer or the program failed, your confidence should be low.
Write nothing after </confidence>.
Example of the ending:
<answer> 1650 </answer>
<confidence> 90 </confidence>"""

# short on purpose: the positive control's tiny random model attends over every prompt token
# (`car_jax.data.chance.question` names the kind several times for the same reason)
CHANCE_SYSTEM = "Name the coin, then rate from 0 to 100 how likely it lands heads."

QUESTION_USER = "Question: {question}"
PROBLEM_USER = "Problem: {question}"


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A system message and a user message with a `{question}` slot."""

    name: str
    system: str
    user: str = QUESTION_USER

    def messages(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.user.format(question=question.strip())}]


TEMPLATES = {
    "search": PromptTemplate("search", SEARCH_SYSTEM),
    "direct": PromptTemplate("direct", DIRECT_SYSTEM),
    "tir": PromptTemplate("tir", TIR_SYSTEM, PROBLEM_USER),
    "mixed": PromptTemplate("mixed", MIXED_SYSTEM),
    "qwen": PromptTemplate("qwen", QWEN_SYSTEM),
    "chance": PromptTemplate("chance", CHANCE_SYSTEM, "{question}"),
}


def make_prompt(example, template: str | PromptTemplate = "search") -> list[dict]:
    """A QAExample (or a bare question string) -> chat messages [system, user]."""
    if isinstance(template, str):
        if template not in TEMPLATES:
            raise ValueError(f"unknown prompt template {template!r}; choose one of {sorted(TEMPLATES)}")
        template = TEMPLATES[template]
    question = example if isinstance(example, str) else example.question
    return template.messages(question)
