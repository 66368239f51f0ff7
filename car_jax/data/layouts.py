"""Dataset layouts: the columns a row has decide how it becomes a `QAExample`.

| layout    | task | question | gold (the first one a row holds)                 | also needs     | own id        |
|-----------|------|----------|--------------------------------------------------|----------------|---------------|
| search_r1 | qa   | question | golden_answers, reward_model.ground_truth.target | reward_model   | (none)        |
| qa        | qa   | question | golden_answers, answer, answers                  |                | id, unique_id |
| simpleqa  | qa   | problem  | answer                                           | original_index | (none)        |
| math500   | math | problem  | answer                                           |                | id, unique_id |
| aime      | math | Problem  | Answer                                           |                | ID            |

The first layout (in this order) whose columns a table has is its layout; a table that fits
none fails with every layout and the columns it lacks. A file's rows share one layout; each
line of a JSONL file picks its own (its keys are its columns).

Ids and groups (car_jax's decision): an example's `id` and `group_id` are both
"<data_source>-<index>", index being Search-R1's `extra_info.index` or SimpleQA's
`original_index` (else the row number), so Search-R1's per-source index (which restarts at 0
for every source of a mixed file) never joins two questions into one GRPO group. A row's own
id (the "own id" column) replaces both. Search-R1's own `id` column ("train_0") is not used:
it restarts per source too. data_source: the row's `data_source`, else the layout's fixed one
(SimpleQA: "simpleqa_verified"), else the file's name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Literal

Task = Literal["qa", "math", "chance"]  # chance: the positive control's coins (`data.chance`)


class DatasetError(ValueError):
    """A dataset that cannot be read or lacks the columns car_jax needs."""


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One question. `golden_answers` are matched by exact match (task "qa") or math
    equivalence (task "math"); task "chance" holds its success probability there
    (`car_jax.data.chance`). `meta` keeps the row's other fields (not hashed or compared)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str
    group_id: str
    task: Task = "qa"
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.task not in ("qa", "math", "chance"):
            raise ValueError(f"QAExample {self.id}: task {self.task!r} is not 'qa', 'math' or 'chance'")
        if not self.golden_answers:
            raise ValueError(f"QAExample {self.id}: no golden answers")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one dataset layout's columns map to a QAExample. Column names may be dotted paths
    into nested records ("reward_model.ground_truth.target")."""

    name: str
    task: Task
    question: str
    gold: tuple[str, ...]  # the first one a row holds is its gold answer(s)
    needs: tuple[str, ...] = ()  # more columns that pick this layout
    own_id: tuple[str, ...] = ()  # a row's own id, replacing "<data_source>-<index>"
    index: str | None = None  # the row's index within its source (else the row number)
    source: str | None = None  # a fixed data_source for rows without one

    def missing(self, columns: Iterable[str]) -> list[str]:
        """The columns (or "a|b" for alternatives) this layout needs and `columns` lacks."""
        have = set(columns)
        out = [c for c in (self.question, *self.needs) if c not in have]
        if not any(g.split(".")[0] in have for g in self.gold):
            out.append("|".join(self.gold))
        return out

    def describe(self) -> str:
        cols = [self.question, "|".join(self.gold), *self.needs]
        return f"{self.name} ({self.task}: {', '.join(cols)})"


LAYOUTS = (
    Layout("search_r1", "qa", "question", ("golden_answers", "reward_model.ground_truth.target"),
           needs=("reward_model",), index="extra_info.index"),
    Layout("qa", "qa", "question", ("golden_answers", "answer", "answers"), own_id=("id", "unique_id")),
    Layout("simpleqa", "qa", "problem", ("answer",), needs=("original_index",), index="original_index",
           source="simpleqa_verified"),
    Layout("math500", "math", "problem", ("answer",), own_id=("id", "unique_id")),
    Layout("aime", "math", "Problem", ("Answer",), own_id=("ID",)),
)


def detect_layout(columns: Iterable[str], where: str) -> Layout:
    """The first of `LAYOUTS` whose columns are all in `columns`; DatasetError naming every
    layout and what it lacks otherwise."""
    columns = list(columns)
    for layout in LAYOUTS:
        if not layout.missing(columns):
            return layout
    known = "\n".join(f"  {layout.describe()}: missing column(s) {layout.missing(columns)}" for layout in LAYOUTS)
    raise DatasetError(f"{where}: columns {sorted(columns)} fit no known layout; rename them to one of "
                       f"(a|b: either column):\n{known}")


def _get(row: dict, path: str) -> Any:
    """row["a"]["b"] for path "a.b"; None where a level is missing."""
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def answers(value: Any, where: str) -> tuple[str, ...]:
    """A gold field (string, number, list or numpy array of them) -> tuple of strings."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars from parquet / TFDS readers
        value = value.tolist()
    if isinstance(value, (str, int, float)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise DatasetError(f"{where}: gold answer must be a string or a list of strings, got {type(value).__name__}")
    out = tuple(str(v).strip() for v in value if v is not None and str(v).strip())
    if not out:
        raise DatasetError(f"{where}: empty gold answer list")
    return out


def to_example(layout: Layout, row: dict, row_no: int, default_source: str, where: str) -> QAExample:
    """One row of `layout` -> QAExample (ids and sources as the module doc says)."""
    gold_path = next((g for g in layout.gold if _get(row, g) is not None), None)
    if gold_path is None:
        raise DatasetError(f"{where}: no gold answer ({layout.name} layout: {' or '.join(layout.gold)})")
    question = str(row.get(layout.question) or "").strip()
    if not question:
        raise DatasetError(f"{where}: empty {layout.question!r}")
    source = str(row.get("data_source") or layout.source or default_source)
    index = _get(row, layout.index) if layout.index else None
    own = next((row[k] for k in layout.own_id if row.get(k) not in (None, "")), None)
    group = str(own) if own is not None else f"{source}-{row_no if index in (None, '') else index}"
    dropped = {layout.question, gold_path, "data_source", *layout.own_id}
    meta = {k: v for k, v in row.items() if k not in dropped}
    return QAExample(id=group, question=question, golden_answers=answers(_get(row, gold_path), where),
                     data_source=source, group_id=group, task=layout.task, meta=meta)


def rows_to_examples(rows: Iterable[Any], where: str, source: str,
                     columns: Iterable[str] | None = None) -> list[QAExample]:
    """Rows (dicts) -> QAExamples. `columns`: a table's columns (parquet, CSV, TFDS features),
    one layout for every row; None (JSON lines): each row's keys pick its own layout.
    `source`: the data_source of rows without one (the file's or dataset's name)."""
    table_layout = detect_layout(columns, where) if columns is not None else None
    out = []
    for row_no, row in enumerate(rows):
        at = f"{where} row {row_no}"
        if not isinstance(row, dict):
            raise DatasetError(f"{at}: expected an object with named fields, got {type(row).__name__}")
        layout = table_layout or detect_layout(row, at)
        out.append(to_example(layout, row, row_no, source, at))
    return out
