"""car_jax's tools as a chat template sees them, for native tool calling (the `qwen`
protocol: Qwen2.5 / Qwen3 Instruct):

    schemas = tool_schemas(("search", "code"))          # JSON schemas, OpenAI function style
    texts = tool_prompts(tokenizer, [make_prompt(ex, "qwen")], ("search", "code"))
    read_call('{"name": "search", "arguments": {"query": "x"}}')  # -> ("search", "x")

Each chat tool is one function with one string argument: `search(query)`, the retriever,
and `python(code)`, the sandbox. A call becomes the action of the tool's kind (the key of
`Toolbox.tools`: "search", "code"), so the toolbox routes it as any other protocol's.
The prompt is rendered by the tokenizer's own template with `tools=` the schemas: the
model reads its tools in the layout it was trained on. A template without native tools
(none at all, or one that renders the same text with and without `tools=`) is refused
with an error that names the protocol and the fix.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class ChatTool:
    """One function the model may call: its name, the action kind a call becomes, its one
    string argument, and the descriptions the schema shows the model."""
    name: str
    kind: str
    argument: str
    description: str
    argument_description: str

    def schema(self) -> dict:
        """The JSON schema of the function (the `tools=` entry of a chat template)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object",
                           "properties": {self.argument: {"type": "string", "description": self.argument_description}},
                           "required": [self.argument]}}}


CHAT_TOOLS = (
    ChatTool("search", "search", "query",
             "Search the knowledge source and return the best matching documents, each with its title.",
             "What to look for: a few words naming the fact you are missing."),
    ChatTool("python", "code", "code",
             "Run a Python program in a sandbox and return what it prints (print the numbers you need).",
             "The complete program, as plain Python source."),
)
BY_NAME = {t.name: t for t in CHAT_TOOLS}


def tool_schemas(kinds: Sequence[str]) -> list[dict]:
    """The schemas of the chat tools whose action kinds are in `kinds` ("search", "code")."""
    unknown = sorted(set(kinds) - {t.kind for t in CHAT_TOOLS})
    if unknown:
        raise ValueError(f"no chat tool for the action kinds {unknown}: choose from "
                         f"{sorted(t.kind for t in CHAT_TOOLS)}")
    return [t.schema() for t in CHAT_TOOLS if t.kind in kinds]


def read_call(body: str) -> tuple[str, str] | None:
    """The JSON body of one tool call -> (action kind, payload: the search query stripped,
    the program as written), or None when it is not a valid call: malformed JSON, keys other
    than exactly name and arguments, an unknown function, arguments other than exactly the
    function's one argument, a value that is not a string or is blank."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return None
    tool = BY_NAME.get(call["name"]) if isinstance(call["name"], str) else None
    args = call["arguments"]
    if tool is None or not isinstance(args, dict) or set(args) != {tool.argument}:
        return None
    value = args[tool.argument]
    if not isinstance(value, str) or not value.strip():
        return None
    return tool.kind, value.strip() if tool.kind == "search" else value


def tool_prompts(tokenizer, prompts: Sequence[Sequence[dict]], kinds: Sequence[str],
                 setting: str = "rollout.protocol='qwen'") -> list[str]:
    """Chat messages [N] -> prompt texts [N], each rendered by the tokenizer's chat template
    with `tools=` the schemas of `kinds` and the assistant turn opened. Raises ValueError
    naming `setting` (the key=value that asked for native tool calls) when the tokenizer has
    no template or its template ignores tools."""
    check_tool_template(tokenizer, kinds, setting)
    tools = tool_schemas(kinds)
    return [tokenizer.apply_chat_template(list(p), tools=tools, tokenize=False, add_generation_prompt=True)
            for p in prompts]


def check_tool_template(tokenizer, kinds: Sequence[str], setting: str = "rollout.protocol='qwen'") -> None:
    """Raises ValueError unless the tokenizer's chat template renders tools: it must exist,
    and a probe conversation rendered with `tools=` must differ from it rendered without
    and name every tool. The message names `setting`, the key=value that asked for them."""
    fix = (f"{setting} writes native tool calls, so the prompt is rendered by the tokenizer's chat template "
           f"with tools=; use a Qwen2.5 / Qwen3 Instruct tokenizer (the Instruct checkpoint's folder as "
           f"model.path), or a tag protocol (car_search, mixed) instead")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"this tokenizer has no chat template. {fix}")
    probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    tools = tool_schemas(kinds)
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
    missing = [t["function"]["name"] for t in tools if t["function"]["name"] not in with_tools]
    if with_tools == plain or missing:
        raise ValueError(f"this tokenizer's chat template ignores tools= (the prompt does not list "
                         f"{missing or [t['function']['name'] for t in tools]}). {fix}")
