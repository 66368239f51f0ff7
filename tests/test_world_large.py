"""The large offline world (`car_jax.data.world_large`, dataset "world-large"): determinism,
every answer recoverable from its gold docs (or from none), the OOD split's novelty, the
arithmetic answers re-derived from the docs, and BM25 over its corpus."""
import json
import re
from fractions import Fraction

import pytest

from car_jax.calibration import parsing
from car_jax.data import load_dataset, world_arith, world_index, world_large, world_paths
from car_jax.tools.index import load_retriever


def _rows(text):
    return [json.loads(line) for line in text.splitlines()]


def _word(s):
    """A regex matching `s` as whole words."""
    return re.compile(rf"(?<!\w){re.escape(s)}(?!\w)")


@pytest.fixture(scope="module")
def large():
    files = world_large.generate()
    corpus = {d["id"]: d["contents"] for d in _rows(files["corpus.jsonl"])}
    splits = {name.removesuffix(".jsonl"): _rows(text) for name, text in files.items() if name != "corpus.jsonl"}
    return files, corpus, splits


def _title(contents):
    return contents.split("\n", 1)[0].strip('"')


def test_deterministic_per_seed(large, tmp_path, monkeypatch):
    files, _, _ = large
    assert world_large.generate() == files
    other = world_large.generate(seed=world_large.SEED + 1)
    assert other.keys() == files.keys() and all(other[k] != files[k] for k in files)
    # load_dataset / world_paths write exactly the generator's files into the cache, once
    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path))
    paths = world_paths("world-large")
    assert sorted(paths) == sorted(world_large.FILES)
    assert all(paths[k].read_text(encoding="utf-8") == files[f"{k}.jsonl"] for k in paths)
    assert paths["corpus"].parent.name == f"world_large_{world_large.source_key()}"
    assert world_paths("world-large") == paths and not list(tmp_path.glob("*.partial*"))
    arith = load_dataset("world-large", split="arith_dev", limit=3)  # MATH-500 columns: the tir mode's task
    assert [e.task for e in arith] == ["math"] * 3 and arith[0].meta["op"] in world_arith.OPS
    assert parsing.math_equal(f"\\boxed{{{arith[0].golden_answers[0]}}}", [_rows(files["arith_dev.jsonl"])[0]["answer"]])
    dev = load_dataset("world-large")  # dev by default
    assert len(dev) == sum(world_large.SPLITS["dev"]) and {e.task for e in dev} == {"qa"}
    with pytest.raises(ValueError, match="world-large has splits 'train', 'dev', 'ood', 'arith_train', 'arith_dev', "
                                         "'mixed_train' and 'mixed_dev'"):
        load_dataset("world-large", split="test")


def test_sizes_and_format(large):
    files, corpus, splits = large
    assert len(corpus) >= 5000 and list(corpus) == [str(i) for i in range(len(corpus))]
    assert all(re.match(r'^"[^"\n]+"\n\S', c) for c in corpus.values())  # wiki-18: quoted title line
    assert sum(len(t.encode()) for t in files.values()) < 3_000_000  # a few MB at most
    for split, sizes in world_large.SPLITS.items():
        kinds = [r["kind"] for r in splits[split]]
        assert tuple(kinds.count(k) for k in ("single", "two_hop", "hidden", "absent")) == sizes
    assert {k: [r["kind"] for r in splits["ood"]].count(k) for k in world_large.OOD} == world_large.OOD
    # no question in two splits (or twice in one); the mixed splits are drawn from the others by
    # design (tests/test_mixed_world.py checks they leak no dev row into training)
    own = {name: rows for name, rows in splits.items() if not name.startswith("mixed_")}
    questions = [r.get("question") or r["problem"] for rows in own.values() for r in rows]
    assert len(questions) == len(set(questions))
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(ids) == len(set(ids))
    titles = [_title(c) for c in corpus.values()]
    assert len(titles) == len(set(titles))


def test_answers_recoverable_from_gold_docs(large):
    _, corpus, splits = large
    all_text = "\n".join(corpus.values())
    by_title = {_title(c): i for i, c in corpus.items()}
    seen = set()
    for split in ("train", "dev", "ood"):
        for r in splits[split]:
            seen.add(r["kind"])
            gold, ev = r["golden_answers"][0], r["evidence"]
            assert r["entity"] in r["question"], r
            if r["kind"] == "absent":  # the named entity appears in no doc at all
                assert not r["answerable"] and ev == [] and not _word(r["entity"]).search(all_text), r
                continue
            assert by_title[r["entity"]] == ev[0], r  # the first gold doc is the named entity's own
            if r["kind"] == "hidden":  # the doc exists, the asked fact is not in it
                assert not r["answerable"] and len(ev) == 1
                assert not any(_word(g).search(corpus[ev[0]]) for g in r["golden_answers"]), r
                continue
            assert r["answerable"] and _word(gold).search(corpus[ev[-1]]), r
            if r["kind"] == "two_hop":  # the chain: doc 1 names doc 2's entity, which holds the answer
                assert len(ev) == 2 and ev[0] != ev[1]
                assert _word(_title(corpus[ev[1]])).search(corpus[ev[0]]), r
    assert seen == {"single", "two_hop", "hidden", "absent", "new_relation", "paraphrase"}


def test_ood_uses_relations_and_wordings_train_never_does(large):
    _, _, splits = large

    def template(r):
        return r["question"].replace(r["entity"], "{n}")

    train_templates = {template(r) for r in splits["train"] + splits["dev"]}
    train_relations = {r["relation"] for r in splits["train"] + splits["dev"]}
    for r in splits["ood"]:
        assert template(r) not in train_templates, r
        if r["kind"] == "new_relation":
            assert r["relation"] not in train_relations, r
        elif r["kind"] == "paraphrase":
            assert r["relation"] in train_relations, r  # a known relation in a new wording
    ood_relations = {r["relation"] for r in splits["ood"] if r["kind"] == "new_relation"}
    assert len(ood_relations) >= 4


# the test's own readers of the doc sentences holding each number
_FACT = {"founded": r"was founded in (\d+)\.", "length": r"runs for (\d+) kilometres", "born": r"was born in (\d+)\.",
         "year": r"first demonstrated in (\d+)\.", "height": r"rises (\d+) metres", "depth": r"measures (\d+) metres"}


def _fact(doc, name):
    found = re.findall(_FACT[name], doc)
    assert len(found) == 1, (name, doc)
    return int(found[0])


def test_arithmetic_answers_rederived_from_the_docs(large):
    _, corpus, splits = large
    ops = set()
    for r in splits["arith_train"] + splits["arith_dev"]:
        docs = [corpus[i] for i in r["evidence"]]
        op, text = r["op"], r["problem"]
        ops.add(op)
        if op == "years_between":
            a, b = (_fact(d, "founded") for d in docs)
            want = Fraction(abs(a - b))
        elif op == "total_length":
            want = Fraction(sum(_fact(d, "length") for d in docs))
        elif op == "age_at_invention":
            want = Fraction(_fact(docs[1], "year") - _fact(docs[0], "born"))
            assert _word(_title(docs[0])).search(docs[1])  # the invention's doc names this person
        elif op == "mean_height":
            want = Fraction(sum(_fact(d, "height") for d in docs), len(docs))
        elif op == "line_lowered":
            k = int(re.search(r"(\d+) times each", text).group(1))
            want = k * Fraction(sum(_fact(d, "depth") for d in docs))
        else:
            assert op == "ascent_hours"
            v = int(re.search(r"at (\d+) metres per hour", text).group(1))
            want = Fraction(_fact(docs[0], "height"), v)
        assert Fraction(r["answer"]) == want, r
        for d in docs:  # each evidence doc's entity is named in the problem
            assert _title(d) in text, (r, d)
    assert ops == {"years_between", "total_length", "age_at_invention", "mean_height", "line_lowered", "ascent_hours"}


def test_number_text():
    assert [world_arith.number(Fraction(x)) for x in ("12", "-3", "15/2", "3021/400")] == ["12", "-3", "7.5", "7.5525"]
    with pytest.raises(ValueError, match="1/3 has no short terminating decimal"):
        world_arith.number(Fraction(1, 3))


def test_bm25_finds_the_named_entity_among_distractors(large, tmp_path, monkeypatch):
    """The floor: BM25 (top 3) finds the named entity's doc for >= 90% of the dev single-hop
    questions (measured at the default seed: 100% in the top 3, 95% first). A world whose
    names stopped being searchable (a lost title, a mangled name) falls far below it. The
    search is not trivial: for most questions (71% measured) another of the top 3 names the
    same entity (a distractor)."""
    _, corpus, splits = large
    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path))
    retriever = load_retriever(world_index(tmp_path, name="world-large"))
    try:
        rows = [r for r in splits["dev"] if r["kind"] == "single"]
        results = retriever.search([r["question"] for r in rows], topk=3)
    finally:
        retriever.close()
    hits = [r["evidence"][0] in [d.id for d in docs] for r, docs in zip(rows, results)]
    assert sum(hits) / len(hits) >= 0.9
    crowded = [any(d.id != r["evidence"][0] and r["entity"] in d.contents for d in docs) for r, docs in zip(rows, results)]
    assert sum(crowded) / len(crowded) >= 0.5
