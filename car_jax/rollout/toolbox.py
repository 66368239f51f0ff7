"""The tools an episode calls, from one small config that `car-jax train` and `car-jax eval`
share (YAML section `tools`):

    with open_tools("search", ToolsConfig(retriever="world", topk=3)) as box:
        run_episodes(model, tokenizer, prompts, box.tools, ...)

A tool kind is the action kind a protocol emits: "search" (a retriever), "code" (the Python
sandbox), or None (no tool).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from car_jax.data import search_tool, world_index
from car_jax.tools.python_tool import PythonTool
from car_jax.tools.sandbox import SandboxConfig


@dataclasses.dataclass(frozen=True)
class ToolsConfig:
    retriever: str = "world"  # "world" (built-in BM25), an index folder (`car-jax build-index`), or an http(s) URL of a retrieval server
    topk: int = 3  # documents per search
    code_timeout_s: float = 5.0  # seconds per program in the Python sandbox (TIR)

    def __post_init__(self):
        if not self.retriever:
            raise ValueError("retriever='' must be 'world', an index folder or an http(s) URL")
        if self.topk < 1:
            raise ValueError(f"topk={self.topk} must be >= 1")
        if self.code_timeout_s <= 0:
            raise ValueError(f"code_timeout_s={self.code_timeout_s} must be > 0")


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


def open_tools(kind: str | None, cfg: ToolsConfig) -> Toolbox:
    """The tools for one tool kind ("search", "code" or None)."""
    if kind is None:
        return Toolbox({}, "none")
    if kind == "code":
        tool = PythonTool(SandboxConfig(timeout_s=cfg.code_timeout_s))
        return Toolbox({"code": tool}, "python sandbox", [tool])
    if kind != "search":
        raise ValueError(f"unknown tool kind {kind!r}: choose 'search', 'code' or None")
    retriever = search_tool(cfg.retriever)
    if cfg.retriever == "world":
        label = f"world BM25 index {world_index()}"
    elif cfg.retriever.startswith(("http://", "https://")):
        label = f"server {cfg.retriever}"
    else:
        label = f"index {cfg.retriever}"
    return Toolbox({"search": functools.partial(retriever.observe, topk=cfg.topk)}, label, [retriever])
