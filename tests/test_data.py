"""Dataset readers, prompt templates and the built-in offline world."""
import json
import re
from pathlib import Path

import pytest

from car_jax.calibration import parsing
from car_jax.data import (
    LAYOUTS,
    TEMPLATES,
    DatasetError,
    QAExample,
    load_dataset,
    make_prompt,
    world_gen,
    world_index,
    world_paths,
)
from car_jax.tools.index import load_retriever

FIXTURES = Path(__file__).parent / "fixtures" / "data"


# ---------------------------------------------------------------- readers
def _write_search_r1_parquet(path: Path, drop: tuple = ()) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [  # two sources whose extra_info.index both start at 0, as in Search-R1's mixes
        ("nq", "who wrote the toy ballad", ["Ada Quill", "Quill"], 0),
        ("nq", "where is the toy harbour", ["Port Ivel"], 1),
        ("hotpotqa", "which toy river is longer", ["Tarn"], 0),
    ]
    cols = {
        "data_source": [r[0] for r in rows],
        "question": [r[1] for r in rows],
        "golden_answers": [r[2] for r in rows],
        "prompt": [[{"role": "user", "content": f"Question: {r[1]}"}] for r in rows],
        "reward_model": [{"style": "rule", "ground_truth": {"target": r[2]}} for r in rows],
        "extra_info": [{"split": "train", "index": r[3]} for r in rows],
    }
    pq.write_table(pa.table({k: v for k, v in cols.items() if k not in drop}), path)
    return path


def test_search_r1_parquet(tmp_path):
    examples = load_dataset(_write_search_r1_parquet(tmp_path / "train.parquet"))
    assert [e.group_id for e in examples] == ["nq-0", "nq-1", "hotpotqa-0"]
    assert len({e.id for e in examples}) == 3  # unique although the index restarts per source
    assert examples[0].golden_answers == ("Ada Quill", "Quill")
    assert examples[2].data_source == "hotpotqa" and examples[2].task == "qa"
    assert examples[1].meta["extra_info"]["index"] == 1
    # gold falls back to reward_model.ground_truth.target; a folder + split finds the file
    _write_search_r1_parquet(tmp_path / "test.parquet", drop=("golden_answers",))
    from_folder = load_dataset(tmp_path, split="test", limit=2)
    assert [e.golden_answers for e in from_folder] == [("Ada Quill", "Quill"), ("Port Ivel",)]


def test_parquet_errors(tmp_path):
    bad = _write_search_r1_parquet(tmp_path / "bad.parquet", drop=("question",))
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['question'\]"):
        load_dataset(bad)
    no_gold = _write_search_r1_parquet(tmp_path / "nogold.parquet", drop=("golden_answers", "reward_model"))
    with pytest.raises(DatasetError, match="reward_model"):
        load_dataset(no_gold)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet at all")
    with pytest.raises(DatasetError, match="junk.parquet: cannot read as parquet"):
        load_dataset(junk)


def test_plain_jsonl(tmp_path):
    as_list = tmp_path / "qa.json"  # a .json file holding a list of the same objects
    as_list.write_text(json.dumps([json.loads(x) for x in (FIXTURES / "qa.jsonl").read_text().splitlines() if x]))
    assert [e.golden_answers for e in load_dataset(as_list)] == [e.golden_answers for e in load_dataset(FIXTURES / "qa.jsonl")]
    examples = load_dataset(FIXTURES / "qa.jsonl")
    assert [e.id for e in examples] == ["qa-0", "toy-1", "custom-7"]
    assert examples[0].golden_answers == ("Tarn River", "Tarn")
    assert examples[1].golden_answers == ("Maren Holt",) and examples[1].data_source == "toy"
    assert examples[2].question == "How deep is Lake Orm?"
    assert examples[2].golden_answers == ("41", "41 metres") and examples[2].group_id == "custom-7"
    assert all(e.task == "qa" for e in examples)


def test_math500_jsonl():
    examples = load_dataset(FIXTURES / "math500.jsonl")
    assert [e.task for e in examples] == ["math", "math"]
    assert examples[0].id == "test/prealgebra/1.json"
    assert examples[1].golden_answers == ("\\frac{3}{4}",)
    assert examples[0].meta["level"] == 1 and "solution" in examples[0].meta
    assert parsing.math_equal("\\boxed{0.75}", examples[1].golden_answers)


def test_simpleqa_csv():
    examples = load_dataset(FIXTURES / "simpleqa_verified.csv")
    assert [e.id for e in examples] == ["simpleqa_verified-12", "simpleqa_verified-40"]
    assert examples[0].golden_answers == ("1931",)
    assert examples[1].question == 'Who painted "The Grey Ferry" (a toy example)?'
    assert examples[1].meta["multi_step"] == "True" and examples[1].meta["topic"] == "Art"
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['answer'\]"):
        load_dataset(FIXTURES / "simpleqa_missing_answer.csv")


AIME_ROWS = [  # the HF hub's AIME 2024 layout (ID, Problem, Solution, Answer; integer answers)
    {"ID": "2024-I-1", "Problem": "Toy walk: how many minutes does the walk take?", "Solution": "...", "Answer": 204},
    {"ID": "2024-I-2", "Problem": "Toy logs: find $xy$.", "Solution": "...", "Answer": 25},
    {"ID": "2024-II-7", "Problem": "Toy digits: find $Q+R$.", "Solution": "...", "Answer": 699},
]


def test_aime_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(AIME_ROWS), tmp_path / "aime_2024.parquet")
    (tmp_path / "aime_2024.jsonl").write_text("".join(json.dumps(r) + "\n" for r in AIME_ROWS))
    (tmp_path / "aime_2024.json").write_text(json.dumps(AIME_ROWS))
    loaded = [load_dataset(tmp_path / f) for f in ("aime_2024.parquet", "aime_2024.jsonl", "aime_2024.json")]
    assert loaded[0] == loaded[1] == loaded[2]
    examples = loaded[0]
    assert [e.id for e in examples] == [r["ID"] for r in AIME_ROWS] == [e.group_id for e in examples]
    assert [e.golden_answers for e in examples] == [(str(r["Answer"]),) for r in AIME_ROWS]
    assert all(e.task == "math" and e.data_source == "aime_2024" for e in examples)
    assert examples[1].question == AIME_ROWS[1]["Problem"] and examples[1].meta == {"Solution": "..."}
    assert parsing.math_equal("\\boxed{204}", examples[0].golden_answers)
    # copies without ID: "<file>-<row>" groups, unique; string answers stay as they are
    (tmp_path / "no_id.jsonl").write_text("".join(json.dumps({"Problem": r["Problem"], "Answer": str(r["Answer"])}) + "\n"
                                                  for r in AIME_ROWS))
    no_id = load_dataset(tmp_path / "no_id.jsonl", limit=2)
    assert [e.group_id for e in no_id] == ["no_id-0", "no_id-1"]
    assert [e.golden_answers for e in no_id] == [e.golden_answers for e in examples[:2]]


def test_columns_pick_the_layout(tmp_path):
    # SimpleQA's columns in a JSONL file are QA (not MATH-500), a CSV with AIME's columns is math
    row = {"original_index": 3, "problem": "Who painted the toy ferry?", "answer": "Ivo Brand"}
    (tmp_path / "simpleqa.jsonl").write_text(json.dumps(row) + "\n")
    (ex,) = load_dataset(tmp_path / "simpleqa.jsonl")
    assert (ex.task, ex.id, ex.golden_answers) == ("qa", "simpleqa_verified-3", ("Ivo Brand",))
    (tmp_path / "aime.csv").write_text("ID,Problem,Answer\n2024-I-1,Toy walk?,204\n")
    (ex,) = load_dataset(tmp_path / "aime.csv")
    assert (ex.task, ex.id, ex.golden_answers) == ("math", "2024-I-1", ("204",))
    # a table that fits no layout names every layout it knows and what each one lacks
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x"], "label": ["y"]}), tmp_path / "other.parquet")
    with pytest.raises(DatasetError, match=r"columns \['label', 'prompt'\] fit no known layout") as err:
        load_dataset(tmp_path / "other.parquet")
    assert all(f"{layout.name} (" in str(err.value) for layout in LAYOUTS)
    assert "aime (math: Problem, Answer): missing column(s) ['Problem', 'Answer']" in str(err.value)


def test_loader_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: not valid JSON"):
        load_dataset(FIXTURES / "broken.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DatasetError, match=r"unknown extension '.txt'"):
        load_dataset(tmp_path / "data.txt")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "question": "q1", "answer": "x"}\n{"id": "a", "question": "q2", "answer": "y"}\n')
    with pytest.raises(DatasetError, match="duplicate example id 'a'"):
        load_dataset(dup)
    nogold = tmp_path / "nogold.jsonl"
    nogold.write_text('{"question": "q1"}\n')
    with pytest.raises(DatasetError, match=r"qa \(qa: .*\): missing column\(s\) \['golden_answers\|answer\|answers'\]"):
        load_dataset(nogold)
    with pytest.raises(DatasetError, match="pass split="):
        load_dataset(tmp_path)
    with pytest.raises(DatasetError, match="not 'test'"):
        load_dataset("world", split="test")
    with pytest.raises(ValueError, match="no golden answers"):
        QAExample("x", "q", (), "s", "x")


# ---------------------------------------------------------------- prompts
def _layout_example(system: str) -> str:
    return system.split("Example of the layout:\n", 1)[1]


def test_prompt_templates():
    ex = load_dataset("world", limit=1)[0]
    for name in ("search", "direct", "tir"):
        messages = make_prompt(ex, name)
        assert [m["role"] for m in messages] == ["system", "user"]
        assert ex.question in messages[1]["content"]
        assert "<confidence>" in messages[0]["content"]
    assert "<search>" in TEMPLATES["search"].system and "<search>" not in TEMPLATES["direct"].system
    assert "final_answer" in TEMPLATES["tir"].system
    # the layouts the templates show are exactly what the parser accepts
    search = _layout_example(TEMPLATES["search"].system).replace("<information> ... </information>",
                                                                 "<information> Doc 1 ... </information>")
    assert parsing.check_format(search) == (True, "")
    direct = _layout_example(TEMPLATES["direct"].system)
    assert parsing.check_format(direct) == (True, "")
    assert parsing.parse_response(direct).answer == "Paris"
    ending = TEMPLATES["tir"].system.split("Example of the ending:\n", 1)[1]
    assert parsing.parse_confidence(ending) == (0.8, True) and parsing.last_boxed(ending) == "42"
    with pytest.raises(ValueError, match="unknown prompt template 'chatty'"):
        make_prompt(ex, "chatty")


# ---------------------------------------------------------------- the offline world
def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def world():
    paths = world_paths()
    corpus = {d["id"]: d["contents"] for d in _rows(paths["corpus"])}
    questions = {s: _rows(paths[s]) for s in ("train", "dev")}
    return paths, corpus, questions


def test_world_files_match_generator(world):
    paths, _, _ = world
    generated = world_gen.generate()
    assert sorted(generated) == ["corpus.jsonl", "dev.jsonl", "train.jsonl"]
    for name, text in generated.items():
        assert (paths[name.removesuffix(".jsonl")]).read_text(encoding="utf-8") == text, (
            f"{name} is stale: run `python -m car_jax.data.world_gen`")
    assert world_gen.generate(seed=1)["dev.jsonl"] != generated["dev.jsonl"]  # the seed matters


def test_world_contents(world):
    _, corpus, questions = world
    assert 150 <= len(corpus) <= 300 and list(corpus) == [str(i) for i in range(len(corpus))]
    assert all(c.startswith('"') and '"\n' in c for c in corpus.values())  # wiki-18: title line
    norm = parsing.normalize_answer
    all_text = norm(" ".join(corpus.values()))
    templates = " ".join(q for facts in world_gen.FACTS.values() for _, q, _ in facts.values() if q)
    common = set(re.findall(r"[A-Z][a-z]+", templates)) | set(world_gen._FIRST) | {"Lake", "Mount", "River"}
    for split, rows in questions.items():
        assert len(rows) == sum(world_gen.SPLITS[split])
        counts = {k: sum(r["kind"] == k for r in rows) for k in ("single", "two_hop", "hidden", "absent")}
        assert tuple(counts.values()) == world_gen.SPLITS[split]
        for r in rows:
            gold = r["golden_answers"][0]
            if r["answerable"]:  # the gold answer is written in the last evidence doc
                assert re.search(rf"\b{re.escape(gold)}\b", corpus[r["evidence"][-1]]), r
            elif r["kind"] == "hidden":  # the entity has a doc, but it leaves the fact out
                assert not re.search(rf"\b{re.escape(gold)}\b", corpus[r["evidence"][0]]), r
            else:  # absent: the named entity appears nowhere in the corpus
                assert r["evidence"] == []
                names = set(re.findall(r"\b[A-Z][a-z]+\b", r["question"])) - common
                assert names and not any(norm(n) in all_text for n in names), r
    ids = [r["id"] for rows in questions.values() for r in rows]
    assert len(ids) == len(set(ids))
    train_q = {r["question"] for r in questions["train"]}
    assert not train_q & {r["question"] for r in questions["dev"]}
    loaded = load_dataset("world")
    assert len(loaded) == len(questions["dev"]) and loaded[0].meta["kind"] == questions["dev"][0]["kind"]


def test_world_bm25_finds_evidence(world, tmp_path):
    _, _, questions = world
    index = world_index(tmp_path)
    assert world_index(tmp_path) == index  # reused, not rebuilt
    assert not list(tmp_path.glob("*.partial*"))
    retriever = load_retriever(index)
    try:
        rows = [r for split in questions.values() for r in split if r["answerable"]]
        results = retriever.search([r["question"] for r in rows], topk=3)
        hits = [r["evidence"][0] in {d.id for d in docs} for r, docs in zip(rows, results)]
        assert sum(hits) / len(hits) >= 0.8
    finally:
        retriever.close()
