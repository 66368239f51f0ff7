"""`load_dataset("tfds:...")` on a tiny TFDS dataset built here (array_record, no TensorFlow)."""
import ast
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from car_jax.calibration import parsing
from car_jax.data import LAYOUTS, DatasetError, load_dataset
from car_jax.data import tfds_source
from car_jax.eval.config import EvalDataConfig
from car_jax.eval.job import data_label
from car_jax.data.tfds_source import parse_name

# rows of the toy dataset's configs; "aime" mimics AIME 2024 (integer answers, ids)
AIME = {"2024-I-1": ("Toy walk: how many minutes does the walk take?", 204),
        "2024-I-2": ("Toy logs: find xy.", 25),
        "2024-II-7": ("Toy digits: find Q + R.", 699)}
QA = {"Which toy river runs through Velmora?": ["Tarn River", "Tarn"],
      "Who devised the toy lamp?": ["Maren Holt"]}
NAME = "car_jax_toy_math"  # TFDS's snake_case of the builder class below


def _build(data_dir: Path) -> None:
    import tensorflow_datasets as tfds

    features = {
        "aime": {"ID": tfds.features.Text(), "Problem": tfds.features.Text(), "Answer": tfds.features.Scalar(np.int64)},
        "qa": {"question": tfds.features.Text(), "answers": tfds.features.Sequence(tfds.features.Text())},
        "notes": {"text": tfds.features.Text()},  # fits no layout
    }

    class CarJaxToyMath(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        # not registered: car_jax must find it from the prepared files, as a user's dataset
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=n) for n in features]

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                features[self.builder_config.name]))

        def _split_generators(self, dl_manager):
            return {"test": self._generate_examples()}

        def _generate_examples(self):
            rows = {"aime": [{"ID": k, "Problem": p, "Answer": a} for k, (p, a) in AIME.items()],
                    "qa": [{"question": q, "answers": a} for q, a in QA.items()],
                    "notes": [{"text": "a note"}]}[self.builder_config.name]
            yield from enumerate(rows)

    for config in features:
        CarJaxToyMath(data_dir=str(data_dir), config=config, file_format="array_record").download_and_prepare()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    _build(root)
    return root


@pytest.fixture
def tfds_env(data_dir, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(data_dir))
    return data_dir


def test_aime_config_through_the_aime_layout(tfds_env):
    examples = load_dataset(f"tfds:{NAME}/aime:test")
    assert sorted(e.id for e in examples) == sorted(AIME)
    for e in examples:
        problem, answer = AIME[e.id]
        assert e.task == "math" and e.question == problem and e.group_id == e.id
        assert e.golden_answers == (str(answer),)
        assert parsing.math_equal(f"\\boxed{{{answer}}}", e.golden_answers)
    # the split may come from split=, a version may sit in the name, limit keeps the first rows
    assert load_dataset(f"tfds:{NAME}/aime", split="test") == examples
    assert load_dataset(f"tfds:{NAME}/aime:1.0.0:test", split="train", limit=2) == examples[:2]


def test_qa_config_decodes_text_and_makes_unique_groups(tfds_env):
    examples = load_dataset(f"tfds:{NAME}/qa:test")
    assert {e.question: list(e.golden_answers) for e in examples} == QA
    assert all(e.task == "qa" and e.data_source == f"{NAME}/qa" for e in examples)
    assert len({e.group_id for e in examples}) == len(QA)


def test_tfds_errors(tfds_env, tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match=r"splits: \['test'\]"):
        load_dataset(f"tfds:{NAME}/aime")
    with pytest.raises(DatasetError, match="Unknown split 'train'"):
        load_dataset(f"tfds:{NAME}/aime:train")
    with pytest.raises(DatasetError, match=r"columns \['text'\] fit no known layout") as err:
        load_dataset(f"tfds:{NAME}/notes:test")
    assert all(layout.name in str(err.value) for layout in LAYOUTS)
    with pytest.raises(DatasetError, match=f"not found.*{tfds_env}.*set \\$TFDS_DATA_DIR"):
        load_dataset("tfds:no_such_dataset:test")
    with pytest.raises(DatasetError, match="is not a TFDS name"):
        load_dataset("tfds::test")
    # a catalog dataset that is not prepared here: never downloaded
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(DatasetError, match="mnist is not prepared in .* car_jax never downloads"):
        load_dataset("tfds:mnist:test")
    # TFDS's default format, tfrecord, is read through TensorFlow: without it, say so
    monkeypatch.setattr(tfds_source, "_has_tensorflow", lambda: False)
    config = tmp_path / NAME / "aime"
    shutil.copytree(tfds_env / NAME / "aime", config)
    info = next(config.glob("*/dataset_info.json"))
    info.write_text(json.dumps({**json.loads(info.read_text()), "fileFormat": "tfrecord"}))
    with pytest.raises(DatasetError, match="stored as tfrecord.*pip install tensorflow.*array_record"):
        load_dataset(f"tfds:{NAME}/aime:test")


def test_parse_name():
    assert parse_name("tfds:aime_2024:test") == ("aime_2024", "aime_2024", "test")
    assert parse_name("tfds:m/aime:1.*.*:test[:10]", "train") == ("m/aime", "m/aime:1.*.*", "test[:10]")
    assert parse_name("tfds:m/aime", "train") == ("m/aime", "m/aime", "train")
    assert parse_name("tfds:m:1.0.0") == ("m", "m:1.0.0", None)


def test_missing_extra_is_named_and_imported_lazily(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'car_jax\[tfds\]'"):
        load_dataset("tfds:aime_2024:test")
    plain = tmp_path / "qa.jsonl"
    plain.write_text('{"question": "q", "answer": "a"}\n')
    assert load_dataset(plain)[0].golden_answers == ("a",)  # other sources need no tfds
    # car_jax imports tensorflow_datasets only inside functions, never when a module loads
    root = Path(__file__).resolve().parents[1] / "car_jax"
    users = [p for p in root.rglob("*.py") if "tensorflow_datasets" in p.read_text()]
    assert users  # the adapter is among them
    found = [f"{path.name}: {name}" for path in users
             for name in _import_time_imports(ast.parse(path.read_text())) if name.split(".")[0] == "tensorflow_datasets"]
    assert not found


def _import_time_imports(tree: ast.Module) -> list[str]:
    """Modules a file imports when it loads: its imports outside function bodies."""
    names, todo = [], [tree]
    while todo:
        for child in ast.iter_child_nodes(todo.pop()):
            if isinstance(child, ast.Import):
                names += [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                names.append(child.module or "")
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)
    return names


def test_eval_names_its_default_folder_safely():
    """`car-jax eval data.path=tfds:...` names its output folder without colons or slashes."""
    cases = {"tfds:squad/v1:validation": ("squad-v1", "validation"), "tfds:mnist": ("mnist", None),
             "tfds:m/aime:1.0.0:test[:10]": ("m-aime", "test-10")}
    for path, expected in cases.items():
        assert data_label(EvalDataConfig(path=path)) == expected
    assert data_label(EvalDataConfig(path="tfds:squad/v1:validation", split="train")) == ("squad-v1", "train")
