"""Dataset adapters: every supported file becomes a list of `QAExample`.

    load_dataset("world")                          # built-in offline world, dev split
    load_dataset("world", split="train")
    load_dataset("nq_search/", split="test")       # a folder holding test.parquet (or .jsonl/.csv)
    load_dataset("nq_search/train.parquet")        # Search-R1 parquet
    load_dataset("simpleqa_verified.csv")          # SimpleQA-verified
    load_dataset("qa.jsonl") / ("math500.jsonl")   # plain QA JSONL / MATH-500 style JSONL

Ids and groups (car_jax's decision): an example's `id` and `group_id` are both
"<data_source>-<index>", index being Search-R1's `extra_info.index` (else the row number;
SimpleQA's `original_index`), so Search-R1's per-source index (which restarts at 0 for every
source of a mixed file) never joins two questions into one GRPO group. A JSONL row's own
`id` / `unique_id` replaces both. Search-R1's own `id` column ("train_0") is not used: it
restarts per source too. `load_dataset` rejects duplicate ids (resume relies on them).
"""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Literal

import pyarrow.parquet as pq

from car_jax.data.world import world_paths

Task = Literal["qa", "math"]
EXTENSIONS = (".parquet", ".jsonl", ".json", ".csv")
SIMPLEQA_COLUMNS = ("original_index", "problem", "answer")  # the ones car_jax needs


class DatasetError(ValueError):
    """A dataset file that cannot be read or lacks the columns car_jax needs."""


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One question. `golden_answers` are matched by exact match (task "qa") or math
    equivalence (task "math"); `meta` keeps the row's other fields (not hashed or compared)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str
    group_id: str
    task: Task = "qa"
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.task not in ("qa", "math"):
            raise ValueError(f"QAExample {self.id}: task {self.task!r} is not 'qa' or 'math'")
        if not self.golden_answers:
            raise ValueError(f"QAExample {self.id}: no golden answers")


def _answers(value: Any, where: str) -> tuple[str, ...]:
    """A gold field (string, number, list or numpy array of them) -> tuple of strings."""
    if isinstance(value, (str, int, float)):
        value = [value]
    elif hasattr(value, "tolist"):  # numpy arrays from parquet readers
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise DatasetError(f"{where}: gold answer must be a string or a list of strings, got {type(value).__name__}")
    out = tuple(str(v).strip() for v in value if v is not None and str(v).strip())
    if not out:
        raise DatasetError(f"{where}: empty gold answer list")
    return out


def _need(columns: Iterable[str], required: Iterable[str], path: Path, hint: str = "") -> None:
    missing = [c for c in required if c not in set(columns)]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; found {sorted(columns)}{hint}")


def _example(source: str, index: Any, question: Any, golds: tuple, task: Task, meta: dict,
             own_id: Any = None) -> QAExample:
    group = str(own_id) if own_id not in (None, "") else f"{source}-{index}"
    return QAExample(id=group, question=str(question).strip(),
                     golden_answers=golds, data_source=source, group_id=group, task=task, meta=meta)


# ---------------------------------------------------------------- readers
def read_search_r1_parquet(path: str | Path) -> list[QAExample]:
    """Search-R1 data (question, golden_answers, data_source, prompt, reward_model, extra_info).

    Gold: `golden_answers`, else `reward_model.ground_truth.target`. The stored `prompt` is not
    used: car_jax builds its own (`car_jax.data.make_prompt`); it stays in `meta`.
    """
    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
        columns = pq.read_schema(path).names
    except ImportError as err:
        raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from err
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DatasetError(f"{path}: cannot read as parquet ({type(err).__name__}: {err})") from None
    _need(columns, ["question"], path)
    if "golden_answers" not in columns:
        _need(columns, ["reward_model"], path, " (need golden_answers or reward_model.ground_truth.target)")
    out = []
    for row_no, row in enumerate(rows):
        where = f"{path} row {row_no}"
        gold = row.get("golden_answers")
        if gold is None:
            try:
                gold = row["reward_model"]["ground_truth"]["target"]
            except (KeyError, TypeError):
                raise DatasetError(f"{where}: no golden_answers and no reward_model.ground_truth.target") from None
        source = str(row.get("data_source") or path.stem)
        extra = row.get("extra_info") or {}
        index = extra.get("index", row_no) if isinstance(extra, dict) else row_no
        meta = {k: v for k, v in row.items() if k not in ("question", "golden_answers", "data_source")}
        out.append(_example(source, index, row["question"], _answers(gold, where), "qa", meta))
    return out


def read_jsonl(path: str | Path, data_source: str | None = None) -> list[QAExample]:
    """JSONL (or a JSON list): QA lines `{"question", "golden_answers" | "answer"}` or MATH-500
    lines `{"problem", "answer"}` (task "math"). Optional: id / unique_id, data_source."""
    path = Path(path)
    rows = _json_rows(path)
    source = data_source or path.stem
    out = []
    for row_no, row in enumerate(rows):
        where = f"{path} row {row_no}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if "question" in row:
            task, question = "qa", row["question"]
        elif "problem" in row:
            task, question = "math", row["problem"]
        else:
            raise DatasetError(f"{where}: missing field 'question' (QA) or 'problem' (math); has {sorted(row)}")
        gold_key = next((k for k in ("golden_answers", "answer", "answers") if k in row), None)
        if gold_key is None:
            raise DatasetError(f"{where}: missing field 'golden_answers' or 'answer'; has {sorted(row)}")
        src = str(row.get("data_source") or source)
        meta = {k: v for k, v in row.items()
                if k not in ("question", "problem", gold_key, "data_source", "id", "unique_id")}
        own = row.get("id", row.get("unique_id"))
        out.append(_example(src, row_no, question, _answers(row[gold_key], where), task, meta, own))
    return out


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


def read_simpleqa_csv(path: str | Path, data_source: str = "simpleqa_verified") -> list[QAExample]:
    """SimpleQA-verified CSV (original_index, problem, answer, topic, answer_type, multi_step,
    requires_reasoning, urls); extra columns go to `meta`. Task "qa"."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DatasetError(f"{path}: cannot read as CSV ({err})") from None
    _need(columns, SIMPLEQA_COLUMNS, path, " (SimpleQA-verified columns)")
    out = []
    for row_no, row in enumerate(rows):
        meta = {k: v for k, v in row.items() if k not in ("problem", "answer")}
        index = row["original_index"] or row_no
        out.append(_example(data_source, index, row["problem"], _answers(row["answer"], f"{path} row {row_no}"),
                            "qa", meta))
    return out


READERS = {".parquet": read_search_r1_parquet, ".jsonl": read_jsonl, ".json": read_jsonl,
           ".csv": read_simpleqa_csv}


def _resolve(path_or_name: str | Path, split: str | None) -> Path:
    """A name ("world"), a file, or a folder + split -> the file to read."""
    if str(path_or_name) == "world":
        split = split or "dev"
        paths = world_paths()
        if split not in paths or split == "corpus":
            raise DatasetError(f"world has splits 'train' and 'dev', not {split!r}")
        return paths[split]
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
        raise FileNotFoundError(f"dataset {str(path_or_name)!r} not found: give 'world', a file "
                                f"({', '.join(EXTENSIONS)}) or a folder with split=")
    return path


def load_dataset(path_or_name: str | Path, split: str | None = None, limit: int | None = None) -> list[QAExample]:
    """Reads a dataset into QAExamples (the reader is picked by extension, see the module doc).

    `split`: for "world" ("dev" default, or "train") and for folders (<folder>/<split>.<ext>).
    `limit`: keep the first `limit` examples. Raises FileNotFoundError for a missing path,
    DatasetError (a ValueError) for unreadable files, missing columns and duplicate ids.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or None for all)")
    path = _resolve(path_or_name, split)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path}: unknown extension {path.suffix!r}; supported: {', '.join(READERS)}")
    examples = reader(path)
    seen: set[str] = set()
    for e in examples:
        if e.id in seen:
            raise DatasetError(f"{path}: duplicate example id {e.id!r}; ids must be unique (give each row an 'id')")
        seen.add(e.id)
    return examples[:limit] if limit is not None else examples
