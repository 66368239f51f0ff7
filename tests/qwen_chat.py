"""A Qwen2.5-Instruct style tokenizer for the tests, offline: the shipped Qwen2/2.5 vocabulary
(`hf_factory.qwen_tokenizer`, which has neither a chat template nor the tool tokens) with the
tool tags added as the real tokenizer has them (added, not special: `skip_special_tokens`
keeps them) and a chat template written here that renders tools in Qwen2.5-Instruct's
layout:

    <|im_start|>system\\n{system}\\n\\n# Tools\\n\\n{prose}\\n<tools>\\n{schema JSON, one a line}\\n</tools>
    \\n\\n{prose}\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant[\\n{content}](\\n<tool_call>\\n{"name": "f", "arguments": {json}}\\n</tool_call>)*<|im_end|>\\n
    <|im_start|>user(\\n<tool_response>\\n{result}\\n</tool_response>)+<|im_end|>\\n   (consecutive tool messages)
    <|im_start|>assistant\\n                                                       (the generation prompt)

Without tools the system block is `<|im_start|>system\\n{system}<|im_end|>\\n`. The prose
inside the tools block is this file's own; the layout (what the round-trip tests compare)
is Qwen2.5's.
"""
from __future__ import annotations

from tokenizers import AddedToken

from tests.hf_factory import qwen_tokenizer

TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

QWEN25_TOOLS_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}
  {%- set system = messages[0].content %}
  {%- set turns = messages[1:] %}
{%- else %}
  {%- set system = 'You are a helpful assistant.' %}
  {%- set turns = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
  {{- '\\n\\n# Tools\\n\\nThese functions are at your disposal; call one when it helps with the question.\\n\\n' }}
  {{- 'Each signature is a JSON object on its own line, between <tools></tools> tags:\\n<tools>' }}
  {%- for tool in tools %}
    {{- '\\n' + tool | tojson }}
  {%- endfor %}
  {{- '\\n</tools>\\n\\nTo call a function, write a JSON object with its name and its arguments ' }}
  {{- 'between <tool_call></tool_call> tags:\\n<tool_call>\\n' }}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for m in turns %}
  {%- if m.role == 'assistant' and m.tool_calls %}
    {{- '<|im_start|>assistant' }}
    {%- if m.content %}
      {{- '\\n' + m.content }}
    {%- endif %}
    {%- for call in m.tool_calls %}
      {%- set f = call.function if call.function is defined else call %}
      {{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + f.arguments | tojson + '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or loop.previtem.role != 'tool' %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}
      {{- '<|im_end|>\\n' }}
    {%- endif %}
  {%- else %}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


def qwen_tool_tokenizer():
    """The Qwen2/2.5 vocabulary with the tool tags added (not special, as in Qwen2.5's
    tokenizer) and `QWEN25_TOOLS_TEMPLATE` as its chat template."""
    tok = qwen_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tok.chat_template = QWEN25_TOOLS_TEMPLATE
    return tok
