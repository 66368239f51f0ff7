"""Dataset adapters: every supported source becomes a list of `QAExample`.

    load_dataset("world")                          # built-in offline world, dev split
    load_dataset("world", split="train")
    load_dataset("chance")                         # the positive control's coins (car_jax.data.chance)
    load_dataset("world-large", split="ood")       # the large world (car_jax.data.world_large): train, dev,
                                                   # ood, arith_train, arith_dev (math: the tir mode),
                                                   # mixed_train, mixed_dev (the mixed mode)
    load_dataset("nq_search/", split="test")       # a folder holding test.parquet (or .jsonl/.json/.csv)
    load_dataset("nq_search/train.parquet")        # Search-R1 parquet
    load_dataset("simpleqa_verified.csv")          # SimpleQA-verified
    load_dataset("qa.jsonl") / ("math500.jsonl")   # plain QA JSONL / MATH-500 style JSONL
    load_dataset("aime_2024.parquet")              # AIME 2024 (Problem, Answer[, ID]), any of the file types
    load_dataset("tfds:NAME/CONFIG:SPLIT")         # a prepared TensorFlow Datasets dataset (car_jax.data.tfds_source)

The file type only says how to read rows; their columns pick the layout (QA, Search-R1,
SimpleQA, MATH-500, AIME: `car_jax.data.layouts`, which also says how ids and groups are made).
`load_dataset` rejects duplicate ids (resume relies on them).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq

from car_jax.data import chance, tfds_source, world_large
from car_jax.data.layouts import DatasetError, QAExample, rows_to_examples
from car_jax.data.world import FILES as WORLD_FILES
from car_jax.data.world import WORLDS, world_paths

__all__ = ["DatasetError", "QAExample", "check_split", "load_dataset", "read_csv", "read_jsonl", "read_parquet"]

EXTENSIONS = (".parquet", ".jsonl", ".json", ".csv")


# ---------------------------------------------------------------- readers
def read_parquet(path: str | Path) -> list[QAExample]:
    """A parquet table (Search-R1's files, HF hub copies of QA / math sets). Search-R1's stored
    `prompt` is not used: car_jax builds its own (`car_jax.data.make_prompt`); it stays in `meta`."""
    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
        columns = pq.read_schema(path).names
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DatasetError(f"{path}: cannot read as parquet ({type(err).__name__}: {err})") from None
    return rows_to_examples(rows, str(path), path.stem, columns)


def read_jsonl(path: str | Path) -> list[QAExample]:
    """JSONL, or a .json file holding a list of objects; each line's keys pick its layout."""
    path = Path(path)
    return rows_to_examples(_json_rows(path), str(path), path.stem)


def _json_rows(path: Path) -> list:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path}: cannot read ({err})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of objects")
        return data
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    return rows


def read_csv(path: str | Path) -> list[QAExample]:
    """A CSV with a header row (SimpleQA-verified: original_index, problem, answer, topic, ...);
    every value is a string."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DatasetError(f"{path}: cannot read as CSV ({err})") from None
    return rows_to_examples(rows, str(path), path.stem, columns)


READERS = {".parquet": read_parquet, ".jsonl": read_jsonl, ".json": read_jsonl, ".csv": read_csv}


def check_split(path_or_name: str | Path, split: str | None) -> None:
    """Raises DatasetError when a built-in dataset ("world", "world-large", "chance") has no
    split `split` (None: its default). Reads no file, so a config can check it when it is
    built; any other source is checked when it is read."""
    name = str(path_or_name)
    files = {"world": WORLD_FILES, world_large.NAME: world_large.FILES, chance.NAME: chance.SPLITS}.get(name)
    if files is None:
        return
    splits = [k for k in files if k != "corpus"]
    if (split or ("train" if name == chance.NAME else "dev")) not in splits:
        have = [repr(k) for k in splits]
        raise DatasetError(f"{name} has splits {', '.join(have[:-1])} and {have[-1]}, not {split!r}")


def split_of(source: str, split: str | None, key: str) -> None:
    """A built-in dataset's split is checked with the config (`check_split`, no file
    read): ValueError at `key`, `data.train_split: world has splits 'train' and 'dev', not 'dve'`.
    Files and folders are checked when the run starts, before the model loads."""
    try:
        check_split(source, split)
    except DatasetError as err:
        raise ValueError(f"{key}={err}") from None


def _resolve(path_or_name: str | Path, split: str | None) -> Path:
    """A name ("world", "world-large"), a file, or a folder + split -> the file to read."""
    if str(path_or_name) in WORLDS:
        check_split(path_or_name, split)
        return world_paths(str(path_or_name))[split or "dev"]
    path = Path(path_or_name)
    if path.is_dir():
        if split is None:
            raise DatasetError(f"{path} is a folder: pass split= (e.g. 'train' or 'test') to pick <split>.parquet|jsonl|csv")
        found = [path / f"{split}{ext}" for ext in EXTENSIONS if (path / f"{split}{ext}").is_file()]
        if not found:
            raise FileNotFoundError(f"{path} holds no {split}{{{','.join(EXTENSIONS)}}}; files: "
                                    f"{sorted(p.name for p in path.iterdir())[:20]}")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path_or_name)!r} not found: give 'world', 'world-large', a file "
                                f"({', '.join(EXTENSIONS)}), a folder with split= or {tfds_source.PREFIX}NAME[:SPLIT]")
    return path


def load_dataset(path_or_name: str | Path, split: str | None = None, limit: int | None = None) -> list[QAExample]:
    """Reads a dataset into QAExamples (see the module doc for the sources).

    `split`: for "world" ("dev" default, or "train"), "world-large" ("dev" default, "train",
    "ood", "arith_train", "arith_dev", "mixed_train", "mixed_dev"), for folders (<folder>/<split>.<ext>) and
    for "tfds:NAME" (a split in the name wins). `limit`: keep the first `limit` examples.
    Raises FileNotFoundError for a missing path, DatasetError (a ValueError) for unreadable
    files, unknown layouts and duplicate ids, ImportError for tfds: without its extra.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or None for all)")
    if str(path_or_name) == chance.NAME:
        where, examples = chance.NAME, chance.split_examples(split)
    elif str(path_or_name).startswith(tfds_source.PREFIX):
        where, examples = str(path_or_name), tfds_source.read_tfds(str(path_or_name), split)
    else:
        path = _resolve(path_or_name, split)
        reader = READERS.get(path.suffix.lower())
        if reader is None:
            raise DatasetError(f"{path}: unknown extension {path.suffix!r}; supported: {', '.join(READERS)}")
        where, examples = str(path), reader(path)
    seen: set[str] = set()
    for e in examples:
        if e.id in seen:
            raise DatasetError(f"{where}: duplicate example id {e.id!r}; ids must be unique (give each row an 'id')")
        seen.add(e.id)
    return examples[:limit] if limit is not None else examples
