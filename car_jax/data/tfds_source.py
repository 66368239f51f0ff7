"""TensorFlow Datasets as a source: `load_dataset("tfds:NAME[/CONFIG][:VERSION][:SPLIT]")`.

    load_dataset("tfds:aime_2024:test")             # NAME:SPLIT
    load_dataset("tfds:my_math/aime:1.0.0:test")    # NAME/CONFIG:VERSION:SPLIT
    load_dataset("tfds:my_math/aime", split="test") # the split from split= (a split in the name wins)

Reads a dataset already prepared under TFDS's data dir: $TFDS_DATA_DIR (the variable TFDS
itself reads), else TFDS's default (~/tensorflow_datasets). Nothing is downloaded: prepare it
first (`tfds build NAME --data_dir DIR --file_format array_record`, or a builder's
`download_and_prepare(file_format="array_record")`); its builder code need not be importable,
TFDS rebuilds it from the prepared files. The features are the columns: records become examples
through the same layouts as files (`car_jax.data.layouts`), text features decoded as UTF-8.

Needs the `tfds` extra (`pip install 'car_jax[tfds]'`), imported only when a tfds: name is used.
Datasets prepared as array_record or parquet are read without TensorFlow (TFDS's random-access
data source); TFDS's default tfrecord format also needs `tensorflow` installed.
"""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from car_jax.data.layouts import DatasetError, QAExample, rows_to_examples

PREFIX = "tfds:"
DATA_DIR_ENV = "TFDS_DATA_DIR"
_VERSION = r"\d+\.(?:\d+|\*)\.(?:\d+|\*)"  # TFDS's "1.0.0", "1.*.*"
_NAME = re.compile(rf"(?P<name>[^:]+?)(?::(?P<version>{_VERSION}))?(?::(?P<split>.+))?")


def parse_name(spec: str, split: str | None = None) -> tuple[str, str, str | None]:
    """"tfds:NAME[/CONFIG][:VERSION][:SPLIT]" -> (NAME[/CONFIG], TFDS's name with the version,
    split: the name's, else `split`). A split may hold slices ("test[:10]")."""
    match = _NAME.fullmatch(spec.removeprefix(PREFIX)) if spec.startswith(PREFIX) else None
    if match is None:
        raise DatasetError(f"{spec!r} is not a TFDS name: write {PREFIX}NAME[/CONFIG][:VERSION][:SPLIT], "
                           f"e.g. {PREFIX}aime_2024:test")
    version = f":{match['version']}" if match["version"] else ""
    return match["name"], match["name"] + version, match["split"] or split


def _import_tfds():
    try:
        import tensorflow_datasets
    except ImportError as err:
        raise ImportError(f"tfds: datasets need the tensorflow-datasets package ({err}): "
                          "pip install 'car_jax[tfds]'") from None
    return tensorflow_datasets


def _plain(value: Any) -> Any:
    """A decoded TFDS record -> plain Python: numpy values to lists / scalars, bytes to str."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _records(tfds, builder, split: str, spec: str):
    """The split's records: random access (array_record, parquet; no TensorFlow), else tf.data."""
    try:
        return builder.as_data_source(split=split)
    except NotImplementedError:  # tfrecord has no random access
        pass
    except (ValueError, KeyError) as err:  # an unknown split or a bad slice
        raise DatasetError(f"{spec}: {err}") from None
    if not _has_tensorflow():
        raise DatasetError(f"{spec}: stored as {builder.info.file_format.value}, which TFDS reads only with "
                           "TensorFlow: pip install tensorflow, or prepare it again with file_format "
                           "array_record (read without TensorFlow)")
    return tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))


def _has_tensorflow() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def read_tfds(spec: str, split: str | None = None) -> list[QAExample]:
    """A prepared TFDS dataset's split -> QAExamples (see the module doc). data_source: NAME[/CONFIG].
    Raises ImportError without the extra, DatasetError for a dataset that is not there."""
    source, name, split = parse_name(spec, split)
    tfds = _import_tfds()
    data_dir = os.environ.get(DATA_DIR_ENV) or None
    where = data_dir or f"TFDS's default data dir (${DATA_DIR_ENV} is unset)"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except ValueError as err:  # DatasetNotFoundError and bad configs; the first line says which
        raise DatasetError(f"{spec}: {(str(err).splitlines() or [''])[0]} Looked in {where}; set ${DATA_DIR_ENV} to the "
                           f"folder holding {source.split('/')[0]}/") from None
    if not builder.is_prepared():
        raise DatasetError(f"{spec}: {name} is not prepared in {where}, and car_jax never downloads: prepare it "
                           f"first (tfds build {source} --data_dir DIR --file_format array_record)")
    if split is None:
        raise DatasetError(f"{spec}: no split: add :SPLIT to the name or pass split= (splits: {sorted(builder.info.splits)})")
    rows = (_plain(r) for r in _records(tfds, builder, split, spec))
    return rows_to_examples(rows, f"{spec} split {split!r}", source, builder.info.features.keys())
