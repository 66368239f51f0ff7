"""Datasets, prompt templates and the built-in offline world.

    from car_jax.data import load_dataset, make_prompt, world_paths, world_retriever

    examples = load_dataset("world", split="dev")          # list[QAExample]
    messages = make_prompt(examples[0], "search")          # [system, user] chat messages
    retriever = world_retriever()                          # BM25 over the world corpus

Sources: parquet, JSONL/JSON and CSV files (`car_jax.data.examples`) and prepared TensorFlow
Datasets (`tfds:NAME[:SPLIT]`, `car_jax.data.tfds_source`, the `tfds` extra); the columns pick
the layout: Search-R1, plain QA, SimpleQA-verified, MATH-500, AIME (`car_jax.data.layouts`).
Templates: `car_jax.data.prompts`. The world: `car_jax.data.world` (paths, cached index) and
`car_jax.data.world_gen` (the generator that wrote its files).
"""
from car_jax.data.examples import load_dataset, read_csv, read_jsonl, read_parquet
from car_jax.data.layouts import LAYOUTS, DatasetError, Layout, QAExample
from car_jax.data.prompts import TEMPLATES, PromptTemplate, make_prompt
from car_jax.data.world import search_tool, world_index, world_paths, world_retriever

__all__ = ["DatasetError", "LAYOUTS", "Layout", "QAExample", "load_dataset", "read_csv", "read_jsonl",
           "read_parquet", "TEMPLATES", "PromptTemplate", "make_prompt", "search_tool", "world_index",
           "world_paths", "world_retriever"]
