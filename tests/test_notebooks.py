"""Notebooks: committed without outputs, and executed (nbclient, CPU) with their prose's claims
checked against the numbers they compute.

The kernel is this interpreter (the venv's): a kernelspec written to a tmp dir, found through
JUPYTER_PATH, runs `sys.executable -m ipykernel_launcher` with JAX_PLATFORMS=cpu. A cell
appended to the in-memory notebook prints `SUMMARY` (built by the notebook), and any other
notebook variable a test asks for, as JSON.
"""
import json
import sys
import warnings
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from car_jax.calibration import metrics
from tests.conftest import COMPILE_FLAGS

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "car-jax-test"
REPORT = "import json, sys\nprint(json.dumps({{'prefix': sys.prefix, 'summary': SUMMARY{extra}}}))"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def _write_kernelspec(root: Path) -> None:
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "car_jax tests", "language": "python",
        "env": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": COMPILE_FLAGS},  # one CPU device is enough
    }))


def _eval_files(tmp_path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Two fake `car-jax eval` outputs: a calibrated run given as its folder (holding
    samples.jsonl), an overconfident one as a file with only the two required fields."""
    rng = np.random.default_rng(0)
    q = rng.uniform(0, 1, 400).round(2)
    (tmp_path / "calibrated").mkdir()
    runs = {"calibrated": (rng.uniform(size=q.size) < q, q),
            "overconfident.jsonl": (rng.uniform(size=q.size) < 0.3, np.full(q.size, 0.9))}
    for name, (correct, conf) in runs.items():
        rows = [{"correct": bool(c), "confidence": float(x)} for c, x in zip(correct, conf)]
        if name == "calibrated":
            rows = [{"id": str(i), **r, "format_ok": True} for i, r in enumerate(rows)]
        path = tmp_path / name / "samples.jsonl" if name == "calibrated" else tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {str(tmp_path / name): run for name, run in runs.items()}


def _execute(path: Path, tmp_path: Path, monkeypatch, parameters: str, report: str = ""):
    """Runs the notebook with `parameters` appended to its parameters cell -> (nb, report);
    `report` adds entries (`, 'key': expression`) to the report's dict."""
    _write_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # connection files and IPython's profile in tmp too: HOME may be read-only in CI
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = nbformat.read(path, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source += "\n" + parameters
    nb.cells.append(nbformat.v4.new_code_cell(REPORT.format(extra=report)))
    NotebookClient(nb, kernel_name=KERNEL, timeout=300,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    (out,) = [o for o in nb.cells[-1].outputs if o.output_type == "stream"]
    return nb, json.loads(out.text)


def test_reward_ablations_notebook(tmp_path, monkeypatch):
    evals = _eval_files(tmp_path)
    nb, report = _execute(NOTEBOOKS / "reward_ablations.ipynb", tmp_path, monkeypatch,
                          f"EVAL_FILES = {sorted(evals)!r}")
    assert report["prefix"] == sys.prefix  # the kernel ran in this venv
    s = report["summary"]

    # 1. landscapes: Brier at w = 1 overlaps at q = 0, the others separate right from wrong
    assert s["landscape_gap"]["brier"] == pytest.approx(0.0, abs=1e-6)
    assert s["landscape_gap"]["weighted_brier"] == pytest.approx(0.5, abs=1e-6)
    assert s["landscape_gap"]["mscr"] == pytest.approx(1.0, abs=1e-6)
    assert s["mscr_minus_scaled_weighted_brier"] < 1e-5
    # 2. numeric q*(p) matches the formulas to the grid's resolution (1e-3)
    assert s["q_star_max_error"] <= 1e-3
    assert s["binary_spread_over_q"] == 0.0

    # 3. the simulation, claim by claim as the prose states them
    sim = s["sim"]
    for norm in ("grpo", "dr_grpo"):
        binary, brier, mscr = sim[norm]["binary"], sim[norm]["brier"], sim[norm]["mscr"]
        assert binary["min_attempt"] > 0.9  # binary never abstains ...
        assert binary["mean_confidence"] > binary["accuracy"] + 0.2  # ... nor calibrates
        assert binary["accuracy"] > binary["start_accuracy"] + 0.1
        assert brier["min_attempt"] < 0.6  # Brier at w = 1 collapses ...
        assert brier["min_accuracy"] < brier["start_accuracy"] - 0.02  # ... below its start
        assert brier["ece"] < min(mscr["ece"], binary["ece"])  # ... which ECE hides
        assert mscr["ece"] < binary["ece"] - 0.1
        # MSCR(1, 1) = 2 x weighted Brier(0.5): the same training up to GRPO's eps
        wb = sim[norm]["weighted_brier"]
        assert abs(wb["accuracy"] - mscr["accuracy"]) < 0.01
    dr, grpo = sim["dr_grpo"], sim["grpo"]
    assert dr["mscr"]["min_attempt"] > 0.9  # Dr.GRPO: MSCR never collapses
    assert abs(dr["mscr"]["accuracy"] - dr["binary"]["accuracy"]) < 0.02
    assert dr["mscr"]["accuracy"] > dr["brier"]["accuracy"] + 0.02
    assert grpo["mscr"]["min_attempt"] < 0.6  # GRPO: MSCR collapses too ...
    assert grpo["mscr"]["min_attempt"] - grpo["brier"]["min_attempt"] < 0.15  # ... nearly as deep
    # without the abstain action there is no collapse: Brier-1 ends where MSCR does
    na = s["no_abstain"]
    assert abs(na["brier"]["accuracy"] - na["mscr"]["accuracy"]) < 0.03

    # 4. the sweep: rows b1, columns b2
    b = s["sweep"]["b"]
    lo, hi, one = b.index(min(b)), b.index(max(b)), b.index(1.0)
    for norm in ("grpo", "dr_grpo"):
        ece = np.array(s["sweep"][norm]["ece"])
        assert ece.shape == (len(b), len(b))
        assert ece[hi, lo] > ece[one, one]  # b1 >> b2 pays for overconfidence
        assert ece[hi, lo] == pytest.approx(ece.max(), abs=0.02)
    for i, j in enumerate(np.argmin(s["sweep"]["dr_grpo"]["ece"], axis=1)):
        assert b[j] in (b[i], 2 * b[i])  # Dr.GRPO: each row's best ECE at b2 = b1 or 2 b1
    att = np.array(s["sweep"]["dr_grpo"]["attempt_rate"])
    assert np.all(att[np.tril_indices(len(b), -1)] > 0.9)  # Dr.GRPO: b2 < b1 never abstains
    assert att[one, one] > 0.9
    assert att[lo, hi] < 0.8  # a large b2 brings the collapse back, relative to b1 ...
    assert att[hi, hi] < att[one, one] - 0.1  # ... and in absolute terms
    grpo_att = np.array(s["sweep"]["grpo"]["attempt_rate"])
    assert grpo_att.max() - grpo_att.min() < 0.15  # GRPO: insensitive to b1, b2

    # 5. eval files: the notebook's metrics are metrics.calibration's, with a diagram each
    assert sorted(s["eval"]) == sorted(evals)
    for path, (correct, conf) in evals.items():
        want = metrics.calibration(correct, conf)
        got = s["eval"][path]
        for key in ("accuracy", "ece", "mcip", "auroc"):
            assert got[key] == pytest.approx(want[key], abs=1e-5)
        assert 0 <= got["ece_ci"][0] < got["ece_ci"][1] <= 1
    calibrated, overconfident = s["eval"][min(evals)], s["eval"][max(evals)]
    assert calibrated["ece_ci"][1] < overconfident["ece_ci"][0]  # the intervals separate them
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 5  # landscapes, q*, training curves, sweep, reliability diagrams


def test_quickstart_notebook(tmp_path, monkeypatch):
    """The quickstart on the embedded SmolLM2: one episode, its reward, calibration on dev."""
    # the model conversion and the world index go to a tmp cache, not HOME
    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))
    out_dir = tmp_path / "eval"
    # One dev question, the episode's own (EXAMPLE = 0), instead of the notebook's 12 after
    # question 1: every claim below holds for any number, and the calibration section then
    # runs the episode's greedy trajectory again on the programs the episode compiled (each
    # batch size compiles every decode window and prefill of the 30 layers anew: most of the
    # notebook's run time).
    nb, report = _execute(NOTEBOOKS / "quickstart.ipynb", tmp_path, monkeypatch,
                          f"OUT_DIR = {str(out_dir)!r}\nN_QUESTIONS = 1\nEXAMPLE = 0", ", 'episode_text': traj.text")
    assert report["prefix"] == sys.prefix
    s = report["summary"]

    # 2. one episode: at least one turn, at most the tool turns plus the answer-only turn
    ep = s["episode"]
    assert 1 <= ep["n_turns"] <= ep["max_turns"] + 1
    assert ep["tool_log_len"] == ep["n_tool_calls"] <= ep["max_turns"]
    assert 1 <= ep["sampled_tokens"] <= ep["n_turns"] * ep["max_response_tokens"]
    assert ep["response_tokens"] >= ep["sampled_tokens"]

    # 3. the reward is MSCR's formula, recomputed here from its inputs
    sc = s["score"]
    c, q, ok = sc["correct"], sc["q"], sc["format_ok"]
    assert c in (0.0, 1.0) and ok in (0.0, 1.0) and 0.0 <= q <= 1.0
    want = c * (1 + sc["b1"] * (1 - (1 - q) ** 2)) - (1 - c) * sc["b2"] * q**2 - sc["format_penalty"] * (1 - ok)
    assert sc["reward"] == pytest.approx(want, abs=1e-6)
    assert (sc["b1"], sc["b2"], sc["format_penalty"]) == (1.0, 1.0, 0.5)  # the defaults the prose names

    # 4. calibration over the dev questions: metrics.calibration of the samples, in range
    n = s["n_questions"]
    cal = s["calibration"]
    samples = s["samples"]
    assert cal["n"] == n == len(samples["correct"]) == s["eval_summary"]["n"]
    for key in ("accuracy", "ece", "brier", "mean_confidence"):
        assert 0.0 <= cal[key] <= 1.0, key
    single_class = cal["n_correct"] in (0, n)
    assert np.isnan(cal["auroc"]) == single_class
    assert single_class or 0.0 <= cal["auroc"] <= 1.0
    assert np.isnan(cal["mcip"]) == (cal["n_correct"] == n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single class: NaN AUROC with a warning (test_metrics)
        want = metrics.calibration(samples["correct"], samples["confidence"])
    for key in ("accuracy", "ece", "mcip", "auroc", "brier"):
        assert cal[key] == pytest.approx(want[key], abs=1e-6, nan_ok=True), key
        got = s["eval_summary"][key]  # evaluate()'s summary writes NaN as None
        assert (got is None and np.isnan(want[key])) or got == pytest.approx(want[key], abs=1e-6), key
    # evaluate() wrote its four files (the expected confidence's diagram too), one sample line per question
    assert s["files"] == ["reliability.png", "reliability_expected.png", "samples.jsonl", "summary.json"]
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == samples["correct"]
    assert [r["confidence"] for r in rows] == pytest.approx(samples["confidence"])
    # evaluate() ran the same greedy episode as section 2's run_episodes
    assert [r["response"] for r in rows] == [report["episode_text"]]

    # the prose's claims about the untrained model
    assert s["format_rate"] < 0.5  # most trajectories fail the format check
    assert s["eval_summary"]["mean_tool_calls"] < 0.5  # it rarely, if ever, searches
    if cal["n_correct"] == 0 and max(samples["confidence"]) == 0.0:  # the degenerate zero
        assert cal["ece"] == cal["mcip"] == cal["brier"] == 0.0 and np.isnan(cal["auroc"])
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the reliability diagram

