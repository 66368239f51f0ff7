"""`car_jax.eval.runner.evaluate` and `car-jax eval`: files, fields, metrics, resume."""
import dataclasses
import json
import math
import re

import numpy as np
import pytest

import car_jax
import car_jax.eval.runner as ev
from car_jax.calibration import metrics
from car_jax.config import ConfigError, load_config
from car_jax.data import QAExample, load_dataset, world_retriever
from car_jax.eval.config import EvalConfig
from car_jax.rl import confidence as cf
from car_jax.rollout.episode import Trajectory
from car_jax.rollout.generate import prompt_texts
from tests.hf_factory import build, build_agent
from tests.truncated import smollm2_short  # noqa: F401 (a fixture)

FIELDS = {"id": str, "question": str, "golden_answers": list, "response": str, "confidence": float,
          "correct": bool, "format_ok": bool, "n_turns": int, "n_tool_calls": int}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_summary_matches(summary, samples):
    """The summary's metrics are metrics.calibration of samples.jsonl's correct / confidence."""
    with pytest.warns(RuntimeWarning) if len({s["correct"] for s in samples}) == 1 else _nothing():
        recomputed = metrics.calibration([s["correct"] for s in samples], [s["confidence"] for s in samples])
    for key in metrics.KEYS:
        want, got = recomputed[key], summary[key]
        assert (got is None and math.isnan(want)) or got == pytest.approx(want, abs=1e-7), key
    assert summary["n"] == len(samples)
    assert summary["format_rate"] == pytest.approx(np.mean([s["format_ok"] for s in samples]))
    assert summary["mean_turns"] == pytest.approx(np.mean([s["n_turns"] for s in samples]))
    assert summary["mean_tool_calls"] == pytest.approx(np.mean([s["n_tool_calls"] for s in samples]))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- scripted episodes
def _search_text(answer, conf, ok=True):
    lead = "<think> look it up </think>\n<search> the query </search>\n\n<information>Doc 1(Title: x) y\n" \
           "</information>\n\n<think> found it </think>\n"
    return (lead if ok else "I think ") + f"<answer> {answer} </answer>\n<confidence> {conf} </confidence>"


@pytest.fixture()
def scripted(monkeypatch):
    """Replaces run_episodes with a script: question -> response text; records each call."""
    calls, script = [], {}

    def fake(model, tokenizer, prompts, tools, *, config, protocol, seed, stats):
        calls.append({"questions": [p[-1]["content"].split(": ", 1)[1] for p in prompts], "config": config})
        out = []
        for question in calls[-1]["questions"]:
            text = script[question]
            if text == "CRASH":
                raise RuntimeError("simulated crash")
            t = Trajectory(prompt_ids=[1])
            t.text, t.n_turns, t.n_tool_calls, t.answered = text, 1 + text.count("<search>"), text.count("<search>"), True
            # as run_episodes splits it: the <information> blocks are the tool's pieces
            parts = re.split(r"(\n*<information>.*?</information>\n*)", text, flags=re.DOTALL)
            t.pieces = [(part, k % 2 == 0) for k, part in enumerate(parts) if part]
            out.append(t)
        return out

    monkeypatch.setattr(ev, "run_episodes", fake)
    return calls, script


def _toy_examples(n=6):
    return [QAExample(f"toy-{i}", f"toy question {i}?", (f"answer {i}",), "toy", f"toy-{i}", meta={"kind": "k" + str(i % 2)})
            for i in range(n)]


def test_scripted_eval_files_and_metrics(scripted, tmp_path):
    calls, script = scripted
    examples = _toy_examples()
    rows = [("answer 0", 90, True), ("answer 1", 60, True), ("wrong", 80, True), ("wrong", 10, True),
            ("answer 4", 70, False), ("wrong", "lots", True)]
    for e, (a, c, ok) in zip(examples, rows):
        script[e.question] = _search_text(a, c, ok)
    summary = ev.evaluate(None, None, examples, ev.EvalOptions(mode="search", batch_size=4, n_boot=200),
                          tools={"search": lambda q: q}, out_dir=tmp_path, info={"data": "toy"})
    assert [len(c["questions"]) for c in calls] == [4, 2]
    samples = _lines(tmp_path / "samples.jsonl")
    assert [s["id"] for s in samples] == [e.id for e in examples]
    for s in samples:
        for field, typ in FIELDS.items():
            assert isinstance(s[field], typ), (field, s[field])
        assert 0.0 <= s["confidence"] <= 1.0
    assert [s["correct"] for s in samples] == [True, True, False, False, True, False]
    assert [s["confidence"] for s in samples] == pytest.approx([0.9, 0.6, 0.8, 0.1, 0.7, 0.0])
    assert [s["format_ok"] for s in samples] == [True, True, True, True, False, False]
    assert samples[4]["format_reason"].startswith("text outside blocks")
    assert samples[0]["answer"] == "answer 0" and samples[0]["kind"] == "k0"
    assert summary["accuracy"] == pytest.approx(0.5) and summary["ece"] > 0
    _check_summary_matches(summary, samples)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["ece"] == pytest.approx(summary["ece"]) and on_disk["data"] == "toy"
    lo, hi = on_disk["ci95"]["accuracy"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
    assert on_disk["by_kind"]["k0"]["n"] == 3 and on_disk["by_kind"]["k0"]["accuracy"] == pytest.approx(2 / 3)
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    assert "ECE" in ev.format_table(summary) and "accuracy" in ev.format_table(summary)


def test_crash_then_resume(scripted, tmp_path):
    calls, script = scripted
    examples = _toy_examples(7)
    for e in examples:
        script[e.question] = _search_text(e.golden_answers[0], 75)
    script[examples[4].question] = "CRASH"  # the second batch dies
    with pytest.raises(RuntimeError, match="simulated crash"):
        ev.evaluate(None, None, examples, ev.EvalOptions(mode="search", batch_size=3, n_boot=0),
                    tools={"search": len}, out_dir=tmp_path)
    assert [s["id"] for s in _lines(tmp_path / "samples.jsonl")] == ["toy-0", "toy-1", "toy-2"]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"id": "toy-3", "question": "torn li')  # a write cut short by the crash
    with pytest.raises(FileExistsError, match="resume"):
        ev.evaluate(None, None, examples, ev.EvalOptions(mode="search"), tools={"search": len}, out_dir=tmp_path)
    with pytest.raises(ValueError, match="mode"):
        ev.evaluate(None, None, examples, ev.EvalOptions(mode="direct", resume=True), out_dir=tmp_path)
    script[examples[4].question] = _search_text("nope", 20)
    calls.clear()
    summary = ev.evaluate(None, None, examples, ev.EvalOptions(mode="search", batch_size=3, resume=True, n_boot=0),
                          tools={"search": len}, out_dir=tmp_path)
    assert [q for c in calls for q in c["questions"]] == [e.question for e in examples[3:]]
    samples = _lines(tmp_path / "samples.jsonl")  # the torn line is gone, every id once
    assert [s["id"] for s in samples] == [e.id for e in examples]
    assert (summary["run"]["new_examples"], summary["run"]["resumed_examples"]) == (4, 3)
    assert summary["accuracy"] == pytest.approx(6 / 7)
    _check_summary_matches(summary, samples)


def test_direct_and_tir_modes(scripted, tmp_path):
    calls, script = scripted
    qa = _toy_examples(2)
    script[qa[0].question] = "<think> hm </think>\n<answer> answer 0 </answer>\n<confidence> 55 </confidence>"
    script[qa[1].question] = "no tags at all"
    ev.evaluate(None, None, qa, ev.EvalOptions(mode="direct", n_boot=0), out_dir=tmp_path / "direct")
    assert calls[-1]["config"].max_turns == 0  # one segment, no tool
    samples = _lines(tmp_path / "direct" / "samples.jsonl")
    assert [(s["correct"], s["format_ok"], s["confidence"]) for s in samples] == [(True, True, 0.55), (False, False, 0.0)]
    assert samples[1]["answer"] is None

    math = [QAExample("m-0", "What is 6 * 7?", ("42",), "toy", "m-0", task="math"),
            QAExample("m-1", "Simplify 6/8.", ("\\frac{3}{4}",), "toy", "m-1", task="math")]
    script["What is 6 * 7?"] = "```python\nprint(6 * 7)\n```\n```output\n42\n```\n<confidence> 95 </confidence>\n\\boxed{42}"
    script["Simplify 6/8."] = "It is \\boxed{0.7}"
    ev.evaluate(None, None, math, ev.EvalOptions(mode="tir", n_boot=0), tools={"code": len}, out_dir=tmp_path / "tir")
    samples = _lines(tmp_path / "tir" / "samples.jsonl")
    assert [(s["correct"], s["format_ok"], s["answer"]) for s in samples] == [(True, True, "42"), (False, False, "0.7")]
    with pytest.raises(ValueError, match="mode 'tir' scores math"):
        ev.evaluate(None, None, qa, ev.EvalOptions(mode="tir"), tools={"code": len}, out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="needs a 'search' tool"):
        ev.evaluate(None, None, qa, ev.EvalOptions(mode="search"), out_dir=tmp_path / "y")
    with pytest.raises(ValueError, match="unknown eval mode 'guess'"):
        ev.evaluate(None, None, qa, ev.EvalOptions(mode="guess"), out_dir=tmp_path / "z")


def test_summarize_minimal_rows(tmp_path):
    """Only `correct` and `confidence` are required (the notebooks read other tools' files)."""
    rows = [{"correct": True, "confidence": 0.9}, {"correct": False, "confidence": 0.2},
            {"correct": True, "confidence": 0.6}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = ev.summarize(ev.read_samples(tmp_path / "s.jsonl"), n_boot=0)
    recomputed = metrics.calibration([r["correct"] for r in rows], [r["confidence"] for r in rows])
    assert {k: summary[k] for k in metrics.KEYS} == pytest.approx({k: recomputed[k] for k in metrics.KEYS})
    assert summary["mean_turns"] is None and summary["by_kind"] == {} and summary["ci95"] == {}
    assert summary["mcip"] == pytest.approx(0.2) and summary["auroc"] == pytest.approx(1.0)


# ---------------------------------------------------------------- real episodes
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_short):
    """A tiny random llama with SmolLM2's vocabulary, and SmolLM2's tokenizer from the cut
    folder (its tokenizer files are the converted GGUF's; parsing the GGUF again for them
    would cost seconds)."""
    folder = tmp_path_factory.mktemp("tiny_eval_llama")
    build("llama", folder, vocab_size=49152)
    return folder, car_jax.load_model(folder), car_jax.load_tokenizer(smollm2_short)


def test_tiny_model_search_then_cli_resume(tiny, smollm2_short, tmp_path, monkeypatch, capsys):
    """3 world questions through the Python API, then `car-jax eval output.resume=true` over 6: only the
    3 new ones run (same shapes, so the CLI reuses the compiled decode loop)."""
    from car_jax import cli

    folder, model, tok = tiny
    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))  # the CLI's default world index
    examples = load_dataset("world", limit=6)
    retriever = world_retriever()
    cfg = dataclasses.replace(ev.EVAL_EPISODE, max_turns=1, max_response_tokens=8, max_obs_tokens=32)
    out = tmp_path / "out"
    try:
        options = ev.EvalOptions(mode="search", episode=cfg, batch_size=3, n_boot=50, progress=False)
        first = ev.evaluate(model, tok, examples[:3], options, tools={"search": retriever}, out_dir=out)
    finally:
        retriever.close()
    assert first["run"]["new_examples"] == 3 and len(_lines(out / "samples.jsonl")) == 3
    argv = ["eval", f"model.path={folder}", f"model.tokenizer={smollm2_short}", "mode=search",
            "data.limit=6", "batch_size=3", "episode.max_turns=1", "episode.max_response_tokens=8",
            "episode.max_obs_tokens=32", "output.n_boot=50", f"output.dir={out}", "output.resume=true"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "ECE" in printed and "format valid" in printed and "world:dev" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["run"]["new_examples"], summary["run"]["resumed_examples"]) == (3, 3)
    assert summary["mode"] == "search" and summary["data"] == "world:dev"
    samples = _lines(out / "samples.jsonl")
    assert [s["id"] for s in samples] == [e.id for e in examples]
    for s, e in zip(samples, examples):
        for field, typ in FIELDS.items():
            assert isinstance(s[field], typ), (field, s[field])
        assert 1 <= s["n_turns"] <= 2 and s["golden_answers"] == list(e.golden_answers)
    _check_summary_matches(summary, samples)
    assert (out / "reliability.png").is_file()
    assert cli.main(["eval", f"model.path={tmp_path / 'missing'}", f"output.dir={tmp_path / 'o2'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("car-jax eval: error: model.path=") and "no such file" in err and err.count("\n") == 1


def test_smollm2_direct(smollm2_short, tmp_path):
    """Direct mode end to end on 8 dev questions with the embedded model's tokenizer, chat
    template and weights, cut to two of its layers (tests/truncated.py): the eval loop is the
    same at any depth, and the cut model writes text too (no accuracy bar: it cannot answer)."""
    model, tok = car_jax.load_model(smollm2_short), car_jax.load_tokenizer(smollm2_short)
    cfg = dataclasses.replace(ev.EVAL_EPISODE, max_response_tokens=32)
    examples = load_dataset("world", limit=8)
    summary = ev.evaluate(model, tok, examples,
                          ev.EvalOptions(mode="direct", episode=cfg, batch_size=8, n_boot=100, progress=False),
                          out_dir=tmp_path)
    samples = _lines(tmp_path / "samples.jsonl")
    assert len(samples) == 8 and all(s["response"].strip() for s in samples)  # it really wrote text
    assert all(s["n_turns"] == 1 and s["n_tool_calls"] == 0 for s in samples)
    _check_summary_matches(summary, samples)


def test_read_samples_of_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "samples.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ev.read_samples(missing)
    assert ev.read_samples(missing, missing_ok=True) == []


def test_compare_table_puts_each_metric_beside_its_change():
    before = {"n": 8, "accuracy": 0.25, "ece": 0.40, "mcip": float("nan"), "auroc": None, "brier": 0.30,
              "mean_confidence": 0.65, "format_rate": 0.5, "mean_tool_calls": 1.0}
    after = {**before, "accuracy": 0.5, "ece": 0.125, "auroc": 0.75, "mean_tool_calls": 1.5}
    lines = ev.compare_table({"base": before, "CAR": after}).splitlines()
    assert lines[0].split() == ["metric", "base", "CAR", "change"]
    rows = {" ".join(line.split()[:-3]): line.split()[-3:] for line in lines[2:] if len(line.split()) >= 4}
    assert rows["accuracy"] == ["0.250", "0.500", "+0.250"]
    assert rows["ECE"] == ["0.400", "0.125", "-0.275"]
    assert rows["AUROC"] == ["n/a", "0.750", "n/a"]  # undefined before: no change either
    assert rows["MCIP"] == ["n/a", "n/a", "n/a"]  # NaN counts as undefined
    assert rows["mean tool calls"] == ["1.000", "1.500", "+0.500"]
    assert lines[-1].split() == ["examples", "8", "8"]


# ---------------------------------------------------------------- expected and sampled confidence
@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A tiny random llama with SmolLM2's vocabulary and tokenizer (weights at 10x the default
    scale, so its value distributions are far from uniform)."""
    folder = build_agent(tmp_path_factory.mktemp("agent"), initializer_range=0.2)
    return car_jax.load_model(folder), car_jax.load_tokenizer(folder)


GREEDY = {"toy question 0?": "<think> a </think>\n<answer> answer 0 </answer>\n<confidence> 80 </confidence>",
          "toy question 1?": "<answer> wrong </answer>\n<confidence>30</confidence>",
          "toy question 2?": "<answer> answer 2 </answer>",
          "toy question 3?": "<answer> nope </answer>\n<confidence> 95 </confidence>"}


@pytest.fixture()
def scripted_ids(monkeypatch):
    """run_episodes scripted with real token ids (the prompts as the engine tokenizes them, the
    responses as the model's own tokens): greedy calls answer GREEDY, sampled ones (temperature
    > 0) answer right on even rows with confidence 10 + 20 (row % 4). Records each call."""
    calls = []

    def fake(model, tokenizer, prompts, tools, *, config, protocol, seed, stats):
        calls.append({"questions": [p[-1]["content"].split(": ", 1)[1] for p in prompts], "config": config,
                      "seed": seed})
        out = []
        for i, (question, text) in enumerate(zip(calls[-1]["questions"], prompt_texts(tokenizer, prompts))):
            if config.temperature > 0:
                answer = question.replace("toy question ", "answer ").rstrip("?") if i % 2 == 0 else "no"
                response = f"<answer> {answer} </answer>\n<confidence> {10 + 20 * (i % 4)} </confidence>"
            else:
                response = GREEDY[question]
            ids = tokenizer(response, add_special_tokens=False)["input_ids"]
            t = Trajectory(tokenizer(text, add_special_tokens=False)["input_ids"], ids, np.zeros(len(ids)),
                           np.ones(len(ids), bool))
            t.text, t.pieces, t.n_turns, t.answered = response, [(response, True)], 1, True
            out.append(t)
        return out

    monkeypatch.setattr(ev, "run_episodes", fake)
    return calls


def test_expected_and_sampled_confidence_in_summary_and_samples(agent, scripted_ids, tmp_path):
    model, tok = agent
    examples = _toy_examples(4)
    options = ev.EvalOptions(mode="direct", batch_size=4, n_boot=50, samples=2, sample_top_p=0.9, seed=3)
    summary = ev.evaluate(model, tok, examples, options, out_dir=tmp_path, info={"data": "toy"})
    greedy, sampled = scripted_ids
    assert greedy["config"].temperature == 0 and greedy["seed"] == 3
    assert (sampled["config"].temperature, sampled["config"].top_p, sampled["config"].top_k) == (1.0, 0.9, 0)
    assert sampled["seed"] == 3 + ev.SAMPLE_SEED and sampled["config"].max_turns == 0  # direct mode's one turn
    assert sampled["questions"] == [e.question for e in examples for _ in range(2)]
    rows = _lines(tmp_path / "samples.jsonl")

    # per example: the expected q is value_distribution's at the response's own tag
    for r, e in zip(rows, examples):
        prompt = tok(prompt_texts(tok, [ev.make_prompt(e, "direct")])[0], add_special_tokens=False)["input_ids"]
        found = cf.confidence_prefix(prompt, tok(GREEDY[e.question], add_special_tokens=False)["input_ids"], tok)
        if found is None:  # no tag: q = 0, as a missing stated confidence
            assert (r["expected_confidence"], r["confidence_dist"], r["confidence_mode"], r["confidence_tail"]) == \
                (0.0, None, None, None)
            continue
        want = cf.value_distribution(model, tok, [found[0]], [found[1]])[0]
        assert r["confidence_tail"] == found[1]
        assert r["expected_confidence"] == pytest.approx(float(cf.expected_q(want[None])[0]), abs=1e-6)
        assert r["confidence_mode"] == int(np.argmax(want))
        dist = np.array(r["confidence_dist"])  # rounded to 6 decimals: enough to re-derive q
        assert dist.shape == (101,) and dist.sum() == pytest.approx(1.0, abs=1e-4)
        assert dist @ (np.arange(101) / 100) == pytest.approx(r["expected_confidence"], abs=5e-5)
    assert [r["confidence_tail"] for r in rows] == [" {} </confidence>", "{}</confidence>", None, " {} </confidence>"]
    assert len({r["expected_confidence"] for r in rows}) == 4  # four different numbers
    assert [[s["correct"] for s in r["sampled"]] for r in rows] == [[True, False]] * 4
    assert [s["confidence"] for r in rows for s in r["sampled"]] == pytest.approx([0.1, 0.3, 0.5, 0.7] * 2)

    # summary.json: each section re-derived from samples.jsonl
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    _check_summary_matches(on_disk, rows)
    c = [r["correct"] for r in rows]
    pooled = [s for r in rows for s in r["sampled"]]
    for section, (cc, qq) in {"expected": (c, [r["expected_confidence"] for r in rows]),
                              "sampled": ([s["correct"] for s in pooled], [s["confidence"] for s in pooled])}.items():
        with pytest.warns(RuntimeWarning) if len(set(cc)) == 1 else _nothing():
            want = metrics.calibration(cc, qq)
        for key in metrics.KEYS:
            got = on_disk[section][key]
            assert (got is None and math.isnan(want[key])) or got == pytest.approx(want[key], abs=1e-7), (section, key)
    assert on_disk["expected"]["tag_rate"] == pytest.approx(0.75) and on_disk["expected"]["ci95"]["ece"]
    assert (on_disk["sampled"]["k"], on_disk["sampled"]["episodes"]) == (2, 8)
    assert on_disk["sampled"]["accuracy"] == pytest.approx(0.5) and "ci95" not in on_disk["sampled"]
    assert on_disk["run"]["sampled_episodes"]["sampler"]["top_p"] == 0.9
    assert summary["expected"]["ece"] == pytest.approx(on_disk["expected"]["ece"])
    for name in ("reliability.png", "reliability_expected.png", "reliability_sampled.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"

    table = ev.format_table(summary)
    assert "expected q at the tag (tag in 0.750)" in table and "sampled episodes (k=2, 8 in all)" in table
    lines = ev.compare_table({"before": summary, "after": summary}).splitlines()
    names = [" ".join(line.split()[:-3]) for line in lines[2:]]
    assert {"ECE, expected q", "AUROC, expected q", "Brier, expected q", "ECE, sampled", "Brier, sampled"} <= set(names)
    assert "ECE, sampled" not in ev.compare_table({"x": {k: v for k, v in summary.items() if k != "sampled"}})


def test_summarize_without_every_expected_confidence_warns(tmp_path):
    rows = [{"correct": True, "confidence": 0.9, "expected_confidence": 0.7},
            {"correct": False, "confidence": 0.2}]
    summary = ev.summarize(rows, n_boot=0)
    assert "expected" not in summary and "sampled" not in summary
    assert any("1 of 2 records have no expected_confidence" in w for w in summary["warnings"])
    rows[1]["expected_confidence"] = 0.1
    rows[0]["sampled"], rows[1]["sampled"] = [{"correct": True, "confidence": 0.5}], []
    summary = ev.summarize(rows, n_boot=0)
    assert summary["expected"]["auroc"] == pytest.approx(1.0) and "sampled" not in summary
    assert any("not one k for all" in w for w in summary["warnings"])


def test_eval_config_samples_keys_reach_evaluate(monkeypatch, tmp_path):
    import car_jax.eval.job as job

    cfg = load_config(EvalConfig, None, ["samples=3", "sample_top_p=0.5", "mode=direct", "data.limit=2",
                                         f"output.dir={tmp_path}"])
    assert (cfg.samples, cfg.sample_top_p, EvalConfig().samples, EvalConfig().sample_top_p) == (3, 0.5, 0, 0.95)
    for bad, key in (("samples=-1", "samples"), ("sample_top_p=0", "sample_top_p"),
                     ("sample_top_p=1.5", "sample_top_p")):
        with pytest.raises(ConfigError, match=key):
            load_config(EvalConfig, None, [bad])
    seen = {}
    monkeypatch.setattr(job, "load_eval_model", lambda model_cfg, mesh: (None, None, "a model"))
    monkeypatch.setattr(job, "evaluate", lambda model, tok, examples, options, **_: seen.update(options=options) or {})
    job.run_eval(cfg, progress=False)
    assert (seen["options"].samples, seen["options"].sample_top_p, seen["options"].mode) == (3, 0.5, "direct")
    assert seen["options"] == job.eval_options(cfg, progress=False)
    with pytest.raises(ValueError, match="samples=-2 must be >= 0"):
        ev.evaluate(None, None, _toy_examples(1), ev.EvalOptions(mode="direct", samples=-2), out_dir=tmp_path / "x")
