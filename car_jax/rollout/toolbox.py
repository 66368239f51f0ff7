"""The tools an episode calls, from one small config that `car-jax train` and `car-jax eval`
share (YAML section `tools`):

    with open_tools("search", ToolsConfig(retriever="world", topk=3)) as box:
        run_episodes(model, tokenizer, prompts, box.tools, ...)

A tool kind is the action kind a protocol emits: "search" (a retriever), "code" (the Python
sandbox), None (no tool), or "mixed": both tools in one toolbox, each call routed by its
action kind (`tool_calls.run_tools`), for the `Mixed` protocol.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from car_jax.data import search_tool, world_index
from car_jax.tools.python_tool import PythonTool
from car_jax.tools.sandbox import SandboxConfig

MAX_TOPK = 1_000  # documents per search
MAX_CODE_TIMEOUT_S = 86_400.0  # one day: a program's time limit


@dataclasses.dataclass(frozen=True)
class ToolsConfig:
    retriever: str = "world"  # "world" (built-in BM25), an index folder (`car-jax build-index`), or an http(s) URL of a retrieval server
    topk: int = 3  # documents per search (at most MAX_TOPK)
    code_timeout_s: float = 5.0  # seconds per program in the Python sandbox (TIR; at most MAX_CODE_TIMEOUT_S, a day)

    def __post_init__(self):
        if not self.retriever:
            raise ValueError("retriever='' must be 'world', an index folder or an http(s) URL")
        if self.topk < 1:
            raise ValueError(f"topk={self.topk} must be >= 1")
        if self.topk > MAX_TOPK:
            raise ValueError(f"topk={self.topk} must be <= {MAX_TOPK} (documents per search)")
        if not self.code_timeout_s > 0:
            raise ValueError(f"code_timeout_s={self.code_timeout_s} must be > 0")
        if self.code_timeout_s > MAX_CODE_TIMEOUT_S:
            raise ValueError(f"code_timeout_s={self.code_timeout_s} must be <= {MAX_CODE_TIMEOUT_S:g} (seconds: a day)")


@dataclasses.dataclass
class Toolbox:
    """The batched tools by action kind, a one-line description, and what to close."""
    tools: dict[str, Any]
    label: str
    resources: list = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Closes the retriever's doc store / the sandbox's worker pool."""
        for resource in self.resources:
            resource.close()
        self.resources = []

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


TOOL_KINDS = {None: (), "search": ("search",), "code": ("code",), "mixed": ("search", "code")}


def tool_names(kind: str | None) -> tuple[str, ...]:
    """The action kinds (keys of `Toolbox.tools`) a tool kind opens: "mixed" -> ("search", "code")."""
    if kind not in TOOL_KINDS:
        raise ValueError(f"unknown tool kind {kind!r}: choose 'search', 'code', 'mixed' or None")
    return TOOL_KINDS[kind]


def open_tools(kind: str | None, cfg: ToolsConfig) -> Toolbox:
    """The tools for one tool kind ("search", "code", "mixed" or None)."""
    boxes = [_open_search(cfg) if name == "search" else _open_code(cfg) for name in tool_names(kind)]
    if not boxes:
        return Toolbox({}, "none")
    return Toolbox({k: v for b in boxes for k, v in b.tools.items()}, " + ".join(b.label for b in boxes),
                   [r for b in boxes for r in b.resources])


def _open_code(cfg: ToolsConfig) -> Toolbox:
    tool = PythonTool(SandboxConfig(timeout_s=cfg.code_timeout_s))
    return Toolbox({"code": tool}, "python sandbox", [tool])


def _open_search(cfg: ToolsConfig) -> Toolbox:
    retriever = search_tool(cfg.retriever)
    if cfg.retriever == "world":
        label = f"world BM25 index {world_index()}"
    elif cfg.retriever.startswith(("http://", "https://")):
        label = f"server {cfg.retriever}"
    else:
        label = f"index {cfg.retriever}"
    return Toolbox({"search": functools.partial(retriever.observe, topk=cfg.topk)}, label, [retriever])
