"""Datasets, prompt templates and the built-in offline world.

    from car_jax.data import load_dataset, make_prompt, world_paths, world_retriever

    examples = load_dataset("world", split="dev")          # list[QAExample]
    messages = make_prompt(examples[0], "search")          # [system, user] chat messages
    retriever = world_retriever()                          # BM25 over the world corpus

Readers: Search-R1 parquet, plain QA JSONL, SimpleQA-verified CSV, MATH-500 style JSONL
(`car_jax.data.examples`). Templates: `car_jax.data.prompts`. The world: `car_jax.data.world`
(paths, cached index) and `car_jax.data.world_gen` (the generator that wrote its files).
"""
from car_jax.data.examples import (
    DatasetError,
    QAExample,
    load_dataset,
    read_jsonl,
    read_search_r1_parquet,
    read_simpleqa_csv,
)
from car_jax.data.prompts import TEMPLATES, PromptTemplate, make_prompt
from car_jax.data.world import search_tool, world_index, world_paths, world_retriever

__all__ = ["DatasetError", "QAExample", "load_dataset", "read_jsonl", "read_search_r1_parquet",
           "read_simpleqa_csv", "TEMPLATES", "PromptTemplate", "make_prompt", "search_tool", "world_index",
           "world_paths", "world_retriever"]
