"""`car-jax experiment` end to end on a tiny random model (warm start, 2 arms x 1 seed x 2 GRPO
steps, evaluations on two splits, the equivalence runs) and its report, whose numbers are
re-derived here from the per-example samples files; plus the statistics on hand-made records."""
import json
import re

import numpy as np
import pytest

from car_jax.config import ConfigError, load_config
from car_jax.experiment import ExperimentConfig, stats, verdict
from car_jax.train.sft import demo_confidences
from tests.hf_factory import build_agent


def _ece(correct, q):
    """10 equal-width bins, written out here."""
    correct, q = np.asarray(correct, float), np.asarray(q, np.float32)
    bins = np.minimum(np.floor(q * 10).astype(int), 9)
    return sum(abs(correct[bins == b].mean() - q[bins == b].astype(float).mean()) * (bins == b).mean()
               for b in np.unique(bins))


def _records(correct, q):
    return [{"correct": bool(c), "confidence": float(x)} for c, x in zip(correct, q)]


def test_seed_averaged_point_and_t_interval():
    from scipy import stats as ss

    rng = np.random.default_rng(3)
    per_seed = [_records(rng.random(40) < p, rng.random(40)) for p in (0.3, 0.6, 0.5)]
    s = stats.arm_summary([{"records": r, "summary": {}} for r in per_seed], n_boot=400, seed=1)
    accs = [np.mean([r["correct"] for r in recs]) for recs in per_seed]
    eces = [_ece([r["correct"] for r in recs], [r["confidence"] for r in recs]) for recs in per_seed]
    assert s["accuracy"]["mean"] == pytest.approx(np.mean(accs)) and s["accuracy"]["per_seed"] == pytest.approx(accs)
    assert s["ece"]["mean"] == pytest.approx(np.mean(eces), abs=1e-6)
    # over seeds: the Student t interval of the per-seed values (2 df), cut to [0, 1]
    lo, hi = ss.t.interval(0.95, 2, loc=np.mean(accs), scale=ss.sem(accs))
    assert (s["accuracy"]["lo"], s["accuracy"]["hi"]) == pytest.approx((max(lo, 0.0), min(hi, 1.0)), rel=1e-5)
    # one run: the percentile bootstrap over its questions
    one = stats.arm_summary([{"records": per_seed[1], "summary": {}}], n_boot=400, seed=1)
    assert one["accuracy"]["lo"] < accs[1] < one["accuracy"]["hi"] and one["seeds"] == 1


def test_modal_confidence_and_collapse_note():
    q = [0.55] * 6 + [0.5, 0.58, 0.9, 0.1]  # 55 six times; 0.5 and 0.58 within 5 points of it
    m = stats.modal_confidence(_records([True] * 10, q))
    assert m == pytest.approx({"value": 0.55, "share": 0.6, "near": 0.8})
    runs = {"warm": {"modal": {"value": 0.07, "share": 0.4, "near": 0.5}, "auroc": 0.6},
            "car-s0": {"modal": {"value": 0.55, "share": 0.97, "near": 0.97}, "auroc": 0.5},
            "car-s1": {"modal": {"value": 0.3, "share": 0.2, "near": 0.4}, "auroc": 0.7}}
    note = verdict.collapse_note("id", runs)
    assert note.startswith("id: 1 of the 2 trained policies") and "car-s0 55 on 97%" in note
    assert "car-s1" not in note and "before RL, states about 7 on 50%" in note
    assert verdict.collapse_note("id", {k: v for k, v in runs.items() if k != "car-s0"}) is None


def test_uninformative_demonstration_confidences():
    found = [True, False, True, False]
    assert demo_confidences(4, "informative", found) == [90, 10, 90, 10]
    assert demo_confidences(4, 50, found) == [50] * 4
    drawn = demo_confidences(400, "random", [True] * 400, seed=2)
    assert drawn == demo_confidences(400, "random", [False] * 400, seed=2)  # independent of correctness
    assert min(drawn) >= 0 and max(drawn) <= 100 and len(set(drawn)) > 50
    with pytest.raises(ValueError, match="'informative', 'random' or an integer"):
        demo_confidences(2, 150, found)
    with pytest.raises(ConfigError, match="warm_start.confidence"):
        load_config(ExperimentConfig, None, ["warm_start.confidence=sometimes"])
    with pytest.raises(ConfigError, match="baseline"):
        load_config(ExperimentConfig, None, ["baseline=nobody"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_agent(tmp_path_factory.mktemp("tiny_experiment"), hidden_size=32)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_experiment_then_report_matches_its_samples(tiny, tmp_path, monkeypatch, capsys):
    from car_jax import cli

    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "exp"
    # train.data.limit=4: the 4 prompts of the 2 steps pad to the same width, so each rollout
    # program compiles once for all runs. No KL term (the trainer's, tested with it): no
    # reference forward to compile and run in each run
    argv = ["experiment", f"dir={root}", "seeds=[0]",
            "arms={vanilla: {kind: binary}, car: {kind: mscr}}",
            f"train.model.path={tiny}", "train.data.limit=4", "train.rl.steps=2", "train.rl.prompts_per_step=2",
            "train.rollout.group_size=2", "train.rollout.max_turns=1", "train.rollout.max_response_tokens=8",
            "train.rollout.max_obs_tokens=32", "train.rl.loss.kl_coef=0", "train.mesh.devices=1",
            "train.run.checkpoint_every=1", "train.run.tensorboard=false", "warm_start.steps=2", "warm_start.batch=4", "eval.batch_size=4",
            "eval.n_boot=200", "eval.episode.max_turns=1", "eval.episode.max_response_tokens=8",
            "eval.episode.max_obs_tokens=32", "equivalence.steps=2",
            "eval.splits={id: {path: world, split: dev, limit: 4}, other: {path: world, split: train, limit: 4}}"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "# Results" in printed and "wrote" in printed
    demos = _lines(root / "warm" / "demos.jsonl")
    # the default warm start states uniform random confidences in 0..100, drawn with the seed
    # of the warm start's run (seeds[0] = 0), re-derived here with numpy
    stated = [int(re.search(r"<confidence> (\d+) </confidence>", d["segments"][-1]["text"]).group(1)) for d in demos]
    assert len(demos) == 4 and stated == np.random.default_rng(0).integers(0, 101, size=4).tolist()

    res = json.loads((root / "report" / "results" / "results.json").read_text())
    md = (root / "report" / "RESULTS.md").read_text()
    for split, n in (("id", 4), ("other", 4)):
        for policy in ("warm", "vanilla-s0", "car-s0"):
            samples = _lines(root / "evals" / policy / split / "samples.jsonl")
            assert len(samples) == n
            c = [s["correct"] for s in samples]
            q = [s["confidence"] for s in samples]
            got = res["splits"][split]["policies"][policy.removesuffix("-s0")]
            assert got["n"] == [n]
            assert got["accuracy"]["mean"] == pytest.approx(np.mean(c))
            assert got["ece"]["mean"] == pytest.approx(_ece(c, q), abs=1e-6)
            assert got["brier"]["mean"] == pytest.approx(np.mean((np.asarray(q) - np.asarray(c, float)) ** 2), abs=1e-6)
        assert f"{res['splits'][split]['policies']['car']['accuracy']['mean']:.3f}" in md
        assert res["splits"][split]["verdicts"]["car"].startswith(f"{split}, car:")
        for run in ("warm", "vanilla-s0", "car-s0"):  # the per-run table, re-derived from the samples
            q = [s["confidence"] for s in _lines(root / "evals" / run / split / "samples.jsonl")]
            top = max(sorted(set(q)), key=q.count)
            got = res["splits"][split]["runs"][run]
            assert got["modal"]["value"] == pytest.approx(top) and got["modal"]["share"] == pytest.approx(q.count(top) / n)
            assert f"| {run} | {got['accuracy']:.3f} | {got['ece']:.3f} |" in md
    # per split: a row in its metrics table and one per compared metric against the baseline
    assert len([line for line in md.splitlines() if line.startswith("| car (1 seed) |")]) == 2
    rows = [line for line in md.splitlines() if line.startswith("| car | ")]
    assert [line.split(" | ")[1] for line in rows] == ["accuracy", "ece", "auroc"] * 2
    # one seed: no seed-paired test, so only the McNemar tests (one per split) form Holm's family
    assert res["holm_family"] == 2 and "no seed-paired test" in res["splits"]["id"]["verdicts"]["car"]
    assert res["data_order"] == "per_seed" and res["shuffle_seeds"] == {"vanilla-s0": 0, "car-s0": 0}
    assert "Partial report" not in md
    eq = res["equivalence"]
    assert [s["step"] for s in eq["steps"]] == [1, 2]
    assert all(s["ratio"] == pytest.approx(2.0, rel=1e-5) for s in eq["steps"])  # b = 1: MSCR = 2 x weighted Brier
    for name in ("curves.png", "reliability_id.png", "reliability_other.png"):
        assert (root / "report" / "results" / name).read_bytes()[:4] == b"\x89PNG"

    # the folder keeps its config, but a key car_jax gained since the folder was started
    # (absent from its file) is not a difference: it takes its default on both sides ...
    saved = root / "experiment.yaml"
    lines = saved.read_text().splitlines(keepends=True)
    saved.write_text("".join(line for line in lines if "tool_workers" not in line))
    assert len(saved.read_text().splitlines()) < len(lines)
    # ... so with everything done, a rerun runs no unit and rewrites the same numbers
    timed = len(_lines(root / "progress.jsonl"))
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert len(_lines(root / "progress.jsonl")) == timed
    assert json.loads((root / "report" / "results" / "results.json").read_text())["splits"] == res["splits"]
    assert cli.main([*argv, "--status"]) == 0
    assert f"{timed} of {timed} units done" in capsys.readouterr().out
    # another config is refused before anything runs
    assert cli.main([*argv, "train.rl.steps=3"]) == 2
    assert "another config" in capsys.readouterr().err

    # a tiny random model is never right: give one policy's samples varied values, so that
    # the report (rebuilt from the files alone) has numbers worth re-deriving
    path = root / "evals" / "car-s0" / "id" / "samples.jsonl"
    rows = _lines(path)
    for r, c, q in zip(rows, (True, False, True, False), (0.9, 0.7, 0.35, 0.1)):
        r.update(correct=c, confidence=q)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main([*argv, "--report", "--report-to", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    res = json.loads((tmp_path / "rep" / "results" / "results.json").read_text())["splits"]["id"]
    car, base = res["policies"]["car"], res["policies"]["vanilla"]
    assert car["accuracy"]["mean"] == pytest.approx(0.5) and car["ece"]["mean"] == pytest.approx(
        _ece([1, 0, 1, 0], [0.9, 0.7, 0.35, 0.1]), abs=1e-6)  # = (0.1 + 0.7 + 0.65 + 0.1) / 4
    assert car["auroc"]["mean"] == pytest.approx(0.75)  # pairs (0.9, 0.7) (0.9, 0.1) (0.35, 0.1) right, (0.35, 0.7) not
    assert car["accuracy"]["lo"] <= 0.5 <= car["accuracy"]["hi"] and car["accuracy"]["hi"] > car["accuracy"]["lo"]
    d = res["vs_baseline"]["car"]
    assert d["accuracy"]["mean"] == pytest.approx(0.5 - base["accuracy"]["mean"])
    # McNemar on the 4 paired questions, re-derived from the two samples files
    cb = [s["correct"] for s in _lines(root / "evals" / "vanilla-s0" / "id" / "samples.jsonl")]
    only_car = sum(c and not b for c, b in zip((True, False, True, False), cb))
    assert d["accuracy"]["mcnemar"]["b"] == only_car
    assert "| car (1 seed) | 0.500" in (tmp_path / "rep" / "RESULTS.md").read_text()

    # an evaluation not finished yet: the report leaves that policy out of its split and says so
    (root / "evals" / "car-s0" / "other" / "summary.json").unlink()
    assert cli.main([*argv, "--report", "--report-to", str(tmp_path / "rep2")]) == 0
    capsys.readouterr()
    part = json.loads((tmp_path / "rep2" / "results" / "results.json").read_text())
    assert not part["complete"] and set(part["splits"]["other"]["policies"]) == {"warm", "vanilla"}
    assert part["splits"]["id"]["policies"]["car"]["accuracy"]["mean"] == pytest.approx(0.5)
    assert "Partial report" in (tmp_path / "rep2" / "RESULTS.md").read_text()


def test_shipped_experiment_configs_load_and_plan():
    from pathlib import Path

    from car_jax.experiment import plan

    paths = sorted((Path(__file__).resolve().parents[1] / "configs" / "experiment").glob("*.yaml"))
    assert paths
    for path in paths:
        cfg = load_config(ExperimentConfig, path)
        units = plan(cfg)
        n_runs = len(cfg.arms) * len(cfg.seeds)
        assert len(units) == 1 + n_runs + (1 + n_runs) * len(cfg.eval.splits) + 2 * bool(cfg.equivalence.steps)
        assert cfg.warm_start.confidence != "informative"  # the experiment's warm start says nothing


def test_pruned_folder_keeps_its_records_and_rebuilds_the_warm_start(tiny, tmp_path, monkeypatch, capsys):
    """--prune deletes weights and checkpoints once nothing needs them; a folder that lost the
    warm start's weights (a records-only copy) rebuilds them before its next run, bit for bit."""
    import hashlib

    from car_jax import cli

    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "exp"
    argv = ["experiment", f"dir={root}", "seeds=[0]", "arms={vanilla: {kind: binary}}",
            f"train.model.path={tiny}", "train.data.limit=2", "train.rl.steps=1", "train.rl.prompts_per_step=1",
            "train.rollout.group_size=2", "train.rollout.max_turns=1", "train.rollout.max_response_tokens=4",
            "train.rollout.max_obs_tokens=16", "train.rl.loss.kl_coef=0", "train.mesh.devices=1",
            "train.run.tensorboard=false", "warm_start.steps=2", "warm_start.batch=2", "eval.batch_size=2",
            "eval.n_boot=100", "eval.episode.max_turns=1", "eval.episode.max_response_tokens=4",
            "eval.episode.max_obs_tokens=16", "equivalence.steps=0",
            "eval.splits={id: {path: world, split: dev, limit: 2}}", "--prune"]
    warm = root / "warm"
    assert cli.main([*argv, "--only", "warm"]) == 0
    assert (warm / "warm_start").is_dir()  # not evaluated yet: nothing pruned
    assert cli.main([*argv, "--only", "eval/warm"]) == 0
    capsys.readouterr()
    # its evaluation is done: checkpoints go, the weights stay (the run still needs them)
    assert not (warm / "checkpoints").exists() and not (warm / "warm_start").exists()
    weights = sorted((warm / "hf").glob("*.safetensors"))
    assert weights
    first = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in weights}
    assert json.loads((warm / "weights.sha256.json").read_text()) == first
    for p in weights:  # a copy of the records only
        p.unlink()

    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rebuilding them" in out and "identical to the first build" in out
    rebuilt = [r for r in _lines(root / "progress.jsonl") if r["unit"] == "warm (rebuilt)"]
    assert len(rebuilt) == 1 and rebuilt[0]["identical"] is True
    # everything done: no weights or checkpoints left, every unit still done, the records read
    assert not list(root.rglob("*.safetensors")) and not list(root.rglob("checkpoints"))
    assert (root / "runs" / "vanilla-s0" / "hf" / "config.json").is_file()
    assert cli.main([*argv, "--status"]) == 0
    assert "4 of 4 units done" in capsys.readouterr().out
    md = (root / "report" / "RESULTS.md").read_text()
    assert "rebuilt from its demonstrations 1 time(s)" in md and "identical" in md
    assert "Partial report" not in md


def test_committed_experiment_keeps_its_shared_data_order(monkeypatch):
    """results/experiment_world was run before per-seed data order: its saved config still
    reads as shared (every run shuffle seed 0, as its runs' own configs say), all 32 units are
    done, and its paired comparison re-derives from the samples files."""
    from pathlib import Path

    from car_jax.config import parse_yaml
    from car_jax.experiment import plan, status
    from car_jax.experiment.config import load_experiment
    from car_jax.experiment.report import collect, paired_runs

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the saved config's dir is relative to the repository
    cfg = load_experiment("results/experiment_world/experiment.yaml")
    assert cfg.data_order == "shared"
    for u in plan(cfg):
        if u.kind == "train":
            saved = parse_yaml((u.dir / "config.yaml").read_text())
            assert saved["data"]["shuffle_seed"] == u.config.data.shuffle_seed == 0
            assert saved["seed"] == u.config.seed
    rows = status(cfg)
    assert len(rows) == 32 and all(done for _, done in rows)
    data = collect(cfg)
    seeds, car, base = paired_runs(data["id"], "car", "vanilla")
    assert seeds == [0, 1, 2]
    got = stats.compare(car, base, ["accuracy", "ece"], n_boot=100)
    for s, (a, b) in enumerate(zip(car, base)):
        ca = {r["id"]: r["correct"] for r in a["records"]}
        cb = {r["id"]: r["correct"] for r in b["records"]}
        assert got["accuracy"]["mcnemar"]["per_seed"][s] == [sum(ca[i] and not cb[i] for i in cb),
                                                             sum(cb[i] and not ca[i] for i in cb)]
    eces = [[_ece([r["correct"] for r in x["records"]], [r["confidence"] for r in x["records"]]) for x in runs]
            for runs in (car, base)]
    assert got["ece"]["per_seed"] == pytest.approx(np.subtract(*eces), abs=1e-6)
