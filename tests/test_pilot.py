"""`car-jax pilot` (`car_jax.eval.pilot`): Welch tests against scipy, a scripted study whose
numbers are re-derived from its per-example files (metrics with numpy / sklearn, the bootstrap
intervals from the same resample indices), and the CLI on a tiny random model."""
import json
import math
import types

import jax
import numpy as np
import pytest
import scipy.stats
from sklearn.metrics import roc_auc_score

import car_jax.eval.job as job
import car_jax.eval.runner as ev
from car_jax.config import ConfigError, load_config
from car_jax.data import TEMPLATES, load_dataset
from car_jax.eval import pilot
from car_jax.rollout.episode import Trajectory
from tests.hf_factory import build_agent


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One car_jax cache for the module: world-large is generated and indexed once."""
    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("cache")
        mp.setenv("CAR_JAX_CACHE", str(folder))
        yield folder


# ---------------------------------------------------------------- Welch's t-test
def test_welch_equals_scipy():
    rng = np.random.default_rng(0)
    for n_a, n_b in ((2, 3), (5, 40), (30, 30), (400, 700)):
        a, b = rng.random(n_a), rng.random(n_b) * 0.7 + rng.normal() * 0.1
        got, want = pilot.welch(a, b), scipy.stats.ttest_ind(a, b, equal_var=False)
        va, vb = a.var(ddof=1) / n_a, b.var(ddof=1) / n_b
        df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))  # Welch-Satterthwaite, by hand
        assert got["t"] == pytest.approx(want.statistic, rel=1e-12)
        assert got["p"] == pytest.approx(want.pvalue, rel=1e-9, abs=1e-300)
        assert got["df"] == pytest.approx(df, rel=1e-12)
        assert (got["mean_a"], got["n_a"], got["n_b"]) == (pytest.approx(a.mean()), n_a, n_b)
    far = pilot.welch(np.r_[np.zeros(50), 0.01], np.r_[np.ones(50), 0.99])  # a tiny p
    assert far["p"] == pytest.approx(scipy.stats.ttest_ind(np.r_[np.zeros(50), 0.01], np.r_[np.ones(50), 0.99],
                                                           equal_var=False).pvalue, rel=1e-7)
    # undefined: a group with one value, or no variance at all
    assert math.isnan(pilot.welch([1.0], [0.0, 1.0])["t"]) and math.isnan(pilot.welch([1.0, 1.0], [1.0, 1.0])["p"])
    # two groups that all state 0.9: no test (scipy, from float64 rounding, says t = 3.74, p = 0.002)
    same = pilot.welch(np.full(15, 0.9), np.full(8, 0.9))
    assert math.isnan(same["t"]) and math.isnan(same["p"]) and same["mean_a"] == same["mean_b"] == 0.9
    one = pilot.welch(np.full(15, 0.9), np.r_[np.full(7, 0.9), 0.5])  # one constant group: b's variance alone
    assert one["t"] == pytest.approx(0.4 / 8 / math.sqrt(np.var(np.r_[np.full(7, 0.9), 0.5], ddof=1) / 8))


# ---------------------------------------------------------------- a scripted study
RULES = {  # setting -> (is example i answered right, its confidence in 0..100)
    "direct": lambda i: (i % 3 == 0, 55 + (7 * i) % 40),
    "prompt": lambda i: (i % 2 == 0, 90 - 5 * (i % 3)),
    "rl": lambda i: (i % 4 != 3, 85 if i % 4 != 3 else 20 + (5 * i) % 30),
}
N = 12


def _script(examples_by_kind):
    """A stand-in for run_episodes: the answer and confidence follow RULES by the prompt's
    setting (system message, or the rl model) and the example's index."""
    lookup = {e.question: (kind, i, e) for kind, exs in examples_by_kind.items() for i, e in enumerate(exs)}
    calls = []

    def fake(model, tokenizer, prompts, *args, **kwargs):
        out = []
        for prompt in prompts:
            kind, i, ex = lookup[prompt[-1]["content"].split(": ", 1)[1]]
            direct = prompt[0]["content"] == TEMPLATES["direct"].system
            setting = "rl" if model.tag == "rl" else "direct" if direct else "prompt"
            right, conf = RULES[setting](i)
            answer = ex.golden_answers[0] if right else ("-1" if kind == "verification" else "no idea")
            if kind == "verification" and not direct:
                text = f"```python\nprint(1)\n```\n<confidence> {conf} </confidence>\n\\boxed{{{answer}}}"
            else:
                text = f"<think> t </think>\n<answer> {answer} </answer>\n<confidence> {conf} </confidence>"
            t = Trajectory(prompt_ids=[1])
            t.text, t.pieces, t.n_turns, t.n_tool_calls, t.answered = text, [(text, True)], 1, int(not direct), True
            out.append(t)
        calls.append(len(out))
        return out

    return fake, calls


def _ece(c, q, n_bins=10):
    """ECE with metrics' binning (float32 edges k/10; q = 1 in the last bin), in numpy."""
    edges = (np.arange(n_bins + 1) / n_bins).astype(np.float32)
    b = np.clip(np.searchsorted(edges, np.float32(q), side="right") - 1, 0, n_bins - 1)
    return sum(abs(q[b == k].mean() - c[b == k].mean()) * (b == k).mean() for k in range(n_bins) if (b == k).any())


def _numpy_metrics(c, q):
    c, q = np.asarray(c, float), np.asarray(q, np.float32).astype(float)
    auroc = roc_auc_score(c, q) if 0 < c.sum() < len(c) else math.nan
    mcip = q[c == 0].mean() if (c == 0).any() else math.nan
    return {"accuracy": c.mean(), "ece": _ece(c, q), "mcip": mcip, "auroc": auroc, "brier": np.mean((q - c) ** 2)}


def _bootstrap(c, q, n_boot, seed):
    """The intervals from the resamples metrics.bootstrap_ci draws (the same jax.random
    indices), each resample's metrics computed in numpy / sklearn."""
    c, q = np.asarray(c, bool), np.asarray(q, np.float32)
    keys = jax.random.split(jax.random.key(seed), n_boot)
    indices = np.asarray(jax.vmap(lambda k: jax.random.randint(k, q.shape, 0, q.shape[0]))(keys))  # int32[n_boot, B]
    stats = []
    for idx in indices:
        m = _numpy_metrics(c[idx], q[idx])
        stats.append([m[name] for name in pilot.METRICS])
    lo, hi = np.nanpercentile(np.array(stats), [2.5, 97.5], axis=0)
    return {name: (lo[i], hi[i]) for i, name in enumerate(pilot.METRICS)}


def _fake_models(monkeypatch, tmp_path, fake, calls):
    """Episodes from `fake` (a scripted run_episodes) and models that are only tags ("rl"
    for a path ending in rl, else "base"); makes the rl checkpoint folder tmp_path/rl.
    Returns `calls`."""
    monkeypatch.setattr(ev, "run_episodes", fake)
    monkeypatch.setattr(job, "load_eval_model", lambda cfg, mesh=None: (
        types.SimpleNamespace(mesh=None, tag="rl" if cfg.path.endswith("rl") else "base"), None, cfg.path))
    (tmp_path / "rl").mkdir()
    return calls


def test_scripted_pilot_numbers_rederived(cache, tmp_path, monkeypatch):
    examples = {"evidence": load_dataset("world-large", split="dev", limit=N),
                "verification": load_dataset("world-large", split="arith_dev", limit=N)}
    calls = _fake_models(monkeypatch, tmp_path, *_script(examples))
    cfg = load_config(pilot.PilotConfig, None, [
        "model.path=base", f"checkpoint={tmp_path / 'rl'}", f"evidence_data.limit={N}", f"verification_data.limit={N}",
        "tools.retriever=world", "batch_size=5", "n_boot=200", "seed=3", f"out={tmp_path / 'pilot'}"])
    result = pilot.run_pilot(cfg, log=lambda _: None, progress=False)
    on_disk = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert list(on_disk["cells"]) == ["evidence", "verification"]
    values = {}
    for kind, cells in on_disk["cells"].items():
        assert list(cells) == ["direct", "prompt", "rl"]
        for setting, cell in cells.items():
            rows = [json.loads(x) for x in (tmp_path / "pilot" / kind / setting / "samples.jsonl").read_text().splitlines()]
            assert cell["samples"] == str(tmp_path / "pilot" / kind / setting / "samples.jsonl")
            assert [r["id"] for r in rows] == [e.id for e in examples[kind]]
            c = [r["correct"] for r in rows]
            q = [r["confidence"] for r in rows]
            assert c == [RULES[setting](i)[0] for i in range(N)], (kind, setting)  # the script's answers were scored
            assert q == pytest.approx([RULES[setting](i)[1] / 100 for i in range(N)])
            assert cell["n"] == N and cell["accuracy"] == pytest.approx(np.mean(c), abs=1e-7)
            want = _numpy_metrics(c, q)
            for name in pilot.METRICS:
                assert cell[name] == pytest.approx(want[name], abs=1e-6), (kind, setting, name)
            boot = _bootstrap(c, q, 200, seed=3)
            for name in pilot.METRICS:
                assert cell["ci95"][name] == pytest.approx(boot[name], abs=1e-5), (kind, setting, name)
            lo, hi = cell["ci95"]["accuracy"]
            assert lo <= cell["accuracy"] <= hi and lo < hi
            values[kind, setting] = (np.array(c, float), np.array(q, float))
    # every pair of settings, every quantity, against scipy on the per-example values
    assert len(on_disk["tests"]) == 2 * 3 * 3
    for t in on_disk["tests"]:
        (ca, qa), (cb, qb) = values[t["kind"], t["a"]], values[t["kind"], t["b"]]
        a, b = {"correct": (ca, cb), "calib_error": (abs(qa - ca), abs(qb - cb)),
                "wrong_confidence": (qa[ca == 0], qb[cb == 0])}[t["quantity"]]
        want = scipy.stats.ttest_ind(a, b, equal_var=False)
        assert t["t"] == pytest.approx(want.statistic, rel=1e-6) and t["p"] == pytest.approx(want.pvalue, rel=1e-6)
        assert (t["n_a"], t["n_b"]) == (len(a), len(b))
    assert {(t["a"], t["b"]) for t in on_disk["tests"]} == {("prompt", "direct"), ("rl", "direct"), ("rl", "prompt")}
    assert (tmp_path / "pilot" / "pilot.png").read_bytes()[:4] == b"\x89PNG"
    table = pilot.format_pilot(result)
    assert "verification  rl" in table and "wrong_confidence" in table and "ECE" in table
    # a second run resumes every cell: no episode runs, the same numbers
    before = sum(calls)
    again = pilot.run_pilot(cfg, log=lambda _: None, progress=False)
    assert sum(calls) == before and again["cells"]["evidence"]["rl"]["ece"] == result["cells"]["evidence"]["rl"]["ece"]


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="kinds"):
        load_config(pilot.PilotConfig, None, ["kinds=[search]"])
    with pytest.raises(ConfigError, match="n_boot"):
        load_config(pilot.PilotConfig, None, ["n_boot=0"])
    cfg = load_config(pilot.PilotConfig, None, [f"checkpoint={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="checkpoint=.*nope.*no such file"):
        pilot.cell_configs(cfg)
    cells = pilot.cell_configs(load_config(pilot.PilotConfig, None, ["kinds=[verification]"]))
    assert list(cells) == [("verification", "direct"), ("verification", "prompt")]  # no checkpoint: no rl
    assert [c.mode for c in cells.values()] == ["direct", "tir"]


# ---------------------------------------------------------------- the CLI, a real tiny model
def test_cli_on_a_tiny_model(cache, tmp_path, capsys):
    """The evidence tool's three cells with real episodes (the world-large BM25 tool); the
    tiny model's own folder stands in for the RL checkpoint."""
    from car_jax import cli

    folder = build_agent(tmp_path / "tiny")  # the tokenizer saved beside it: each cell reads it from there
    out = tmp_path / "pilot"
    argv = ["pilot", f"model.path={folder}", "kinds=[evidence]",
            "evidence_data.limit=2", "batch_size=2", "episode.max_turns=1", "episode.max_response_tokens=6",
            "episode.max_obs_tokens=16", "n_boot=20", f"out={out}", "--checkpoint", str(folder)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Welch t-tests" in printed and "evidence" in printed and "pilot.json" in printed
    result = json.loads((out / "pilot.json").read_text())
    assert list(result["cells"]) == ["evidence"] and len(result["tests"]) == 3 * 3
    for setting, cell in result["cells"]["evidence"].items():
        rows = [json.loads(x) for x in (out / "evidence" / setting / "samples.jsonl").read_text().splitlines()]
        assert cell["n"] == len(rows) == 2
        assert cell["accuracy"] == pytest.approx(np.mean([r["correct"] for r in rows]))
        assert cell["mode"] == ("direct" if setting == "direct" else "search")
        assert all(r["n_tool_calls"] == 0 for r in rows) or setting != "direct"
    assert list(result["cells"]["evidence"]) == ["direct", "prompt", "rl"]
    assert (out / "pilot.png").is_file()
    with pytest.raises(SystemExit, match="checkpoint=.*missing.*no such file"):
        cli.main(["pilot", f"out={tmp_path / 'p2'}", "--checkpoint", str(tmp_path / "missing")])


def test_cli_flags_become_overrides():
    from car_jax.cli import build_parser
    from car_jax.cli.pilot import overrides

    args = build_parser().parse_args(["pilot", "--checkpoint", "ck/", "--math500", "m.jsonl", "n_boot=5"])
    assert overrides(args) == ["checkpoint=ck/", "verification_data.path=m.jsonl", "verification_data.split=null", "n_boot=5"]
    cfg = load_config(pilot.PilotConfig, None, overrides(args))
    assert (cfg.checkpoint, cfg.verification_data.path, cfg.verification_data.split) == ("ck/", "m.jsonl", None)
