"""Corpus documents: the wiki-18 JSONL format, a memory-mapped doc store, and rendering.

Corpus format (Search-R1 / FlashRAG wiki-18): one JSON object per line,
`{"id": "0", "contents": "\"Title\"\ntext..."}`: the first line of `contents` is the title
(often wrapped in double quotes), the rest is the text. Lines with `title` and `text` fields
instead of `contents` are accepted and joined the same way. A missing `id` becomes the line's
row number.

Rendering (`render_docs`) is byte-for-byte Search-R1's `_passages2string`:
`Doc i(Title: <first line>) <rest>\n` for i from 1, the title kept as written in the corpus
(quotes included), because checkpoints trained with Search-R1 saw exactly that. Pass
`strip_title_quotes=True` for `Doc 1(Title: Title) ...`.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Doc:
    """One retrieved passage. `score` is the retriever's similarity (None when not asked)."""

    id: str
    contents: str
    score: float | None = None

    @property
    def title(self) -> str:
        """First line of `contents`, surrounding double quotes removed."""
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        """`contents` after the title line."""
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""

    def to_json(self) -> dict:
        """The Search-R1 `document` object: {"id", "contents"}."""
        return {"id": self.id, "contents": self.contents}


def doc_from_json(obj: dict, row: int, score: float | None = None) -> Doc:
    """A corpus line / server `document` object -> Doc. Raises ValueError naming the row."""
    if not isinstance(obj, dict):
        raise ValueError(f"corpus row {row}: expected a JSON object, got {type(obj).__name__}")
    contents = obj.get("contents")
    if contents is None and "text" in obj:
        contents = f'"{obj.get("title", "")}"\n{obj["text"]}'
    if not isinstance(contents, str):
        raise ValueError(
            f'corpus row {row}: needs a string "contents" field (or "title" + "text"), '
            f"got keys {sorted(obj)}"
        )
    return Doc(id=str(obj.get("id", row)), contents=contents, score=score)


def iter_corpus(path: str | Path) -> Iterator[Doc]:
    """Stream the docs of a JSONL corpus file, skipping blank lines."""
    with open(path, "rb") as f:
        row = 0
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            yield doc_from_json(obj, row)
            row += 1


def count_lines(path: str | Path) -> int:
    """Number of non-blank lines (a fast byte scan, for progress bars)."""
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


def render_docs(docs: Sequence[Doc], strip_title_quotes: bool = False) -> str:
    """Docs -> the text the model reads: one `Doc i(Title: t) text` line per doc (i from 1)."""
    out = []
    for i, doc in enumerate(docs, 1):
        title = doc.title if strip_title_quotes else doc.contents.split("\n", 1)[0]
        out.append(f"Doc {i}(Title: {title}) {doc.text}\n")
    return "".join(out)


class DocStore(Sequence):
    """Row number -> Doc over a JSONL file, memory-mapped (a 20M-doc wiki stays on disk).

    `offsets` [N + 1] int64 holds the byte offset of each row's line and the file end.
    """

    def __init__(self, path: str | Path, offsets: np.ndarray):
        self.path = Path(path)
        self.offsets = np.asarray(offsets, np.int64)
        self._file = open(self.path, "rb")
        size = self.path.stat().st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "DocStore":
        """Scan a corpus file for line offsets (blank lines skipped)."""
        offsets, pos = [], 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append(pos)
                pos += len(line)
        offsets.append(pos)
        return cls(path, np.array(offsets, np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row: int) -> Doc:
        if not -len(self) <= row < len(self):
            raise IndexError(f"doc row {row} out of range for a store of {len(self)} docs")
        row %= len(self)
        line = self._map[self.offsets[row] : self.offsets[row + 1]]
        return doc_from_json(json.loads(line), row)

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._file.close()


class DocStoreWriter:
    """Writes docs as canonical `{"id", "contents"}` JSONL plus their offsets (.npy)."""

    def __init__(self, jsonl_path: str | Path):
        self.path = Path(jsonl_path)
        self._f = open(self.path, "wb")
        self._offsets = [0]

    def add(self, doc: Doc) -> None:
        line = json.dumps(doc.to_json(), ensure_ascii=False).encode("utf-8") + b"\n"
        self._f.write(line)
        self._offsets.append(self._offsets[-1] + len(line))

    def close(self) -> np.ndarray:
        """Flush; returns the offsets [N + 1] (also saved as `<path>.offsets.npy`)."""
        self._f.close()
        offsets = np.array(self._offsets, np.int64)
        np.save(offsets_path(self.path), offsets)
        return offsets


def offsets_path(jsonl_path: str | Path) -> Path:
    return Path(str(jsonl_path) + ".offsets.npy")


def open_store(jsonl_path: str | Path) -> DocStore:
    """A store written by DocStoreWriter (offsets from its .npy), else scanned."""
    off = offsets_path(jsonl_path)
    if off.is_file():
        return DocStore(jsonl_path, np.load(off))
    return DocStore.from_jsonl(jsonl_path)
