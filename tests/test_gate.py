"""Confidence-gated tool use (`car-jax eval --gate TAU`): the gating rule on hand-made records,
its errors, and the CLI end to end on a tiny random model, its files re-derived here from
the two evaluations it combines."""
import json

import numpy as np
import pytest

from car_jax.eval import gate
from tests.hf_factory import build_agent


def _rec(i, correct, q, calls=0):
    return {"id": f"q{i}", "correct": correct, "confidence": q, "n_tool_calls": calls, "format_ok": True}


# direct: (correct, q); tool: (correct, q, tool calls)
DIRECT = [(True, 0.9), (False, 0.8), (False, 0.3), (True, 0.5), (False, 0.0)]
TOOL = [(False, 0.4, 1), (True, 0.9, 2), (True, 0.7, 1), (False, 0.6, 3), (True, 0.2, 1)]


def _records():
    direct = [_rec(i, c, q) for i, (c, q) in enumerate(DIRECT)]
    tool = [_rec(i, c, q, n) for i, (c, q, n) in enumerate(TOOL)]
    return direct, tool[::-1]  # the tool records in another order: pairing is by id


def test_gate_records_take_the_tool_below_tau():
    direct, tool = _records()
    recs = gate.gate_records(direct, tool, 0.5)
    # q = 0.9, 0.8 and 0.5 stay direct (>= 0.5); 0.3 and 0.0 run the tool
    assert [r["gated"] for r in recs] == [False, False, True, False, True]
    assert [r["correct"] for r in recs] == [True, False, True, True, True]
    assert [r["confidence"] for r in recs] == [0.9, 0.8, 0.7, 0.5, 0.2]
    assert [r["n_tool_calls"] for r in recs] == [0, 0, 1, 0, 1]
    assert [r["direct_confidence"] for r in recs] == [q for _, q in DIRECT]


def test_curve_rows_equal_a_hand_derivation():
    direct, tool = _records()
    taus = (0.0, 0.5, 0.85, 1.0)
    curve = gate.gate_curve(direct, tool, taus)
    dq = np.array([q for _, q in DIRECT])
    for row, tau in zip(curve, taus):
        use_tool = dq < tau
        correct = np.where(use_tool, [c for c, _, _ in TOOL], [c for c, _ in DIRECT])
        q = np.where(use_tool, [q for _, q, _ in TOOL], dq)
        calls = np.where(use_tool, [n for _, _, n in TOOL], 0)
        assert row["tau"] == tau and row["gated_rate"] == pytest.approx(use_tool.mean())
        assert row["accuracy"] == pytest.approx(correct.mean()) and row["tool_calls"] == pytest.approx(calls.mean())
        assert row["mean_confidence"] == pytest.approx(q.mean())
        assert row["brier"] == pytest.approx(np.mean((q - correct) ** 2))
        # ECE with 10 equal-width bins, written out independently
        bins = np.minimum((q * 10).astype(int), 9)
        ece = sum(abs(correct[bins == b].mean() - q[bins == b].mean()) * (bins == b).mean()
                  for b in np.unique(bins))
        assert row["ece"] == pytest.approx(ece)
    assert curve[0]["gated_rate"] == 0 and curve[0]["tool_calls"] == 0  # TAU 0: never the tool
    assert curve[-1]["gated_rate"] == 1.0  # every direct q < 1: always the tool
    table = gate.format_curve(curve, 0.5)
    assert len(table.splitlines()) == 1 + len(taus) and " 0.50*" in table


def test_bad_tau_and_mismatched_records_are_named():
    with pytest.raises(ValueError, match=r"\[0, 1\].*pass 0.7"):
        gate.check_tau(70)
    with pytest.raises(ValueError, match="must be a confidence"):
        gate.check_tau(-0.1)
    direct, tool = _records()
    with pytest.raises(ValueError, match="different examples"):
        gate.gate_records(direct, tool[:-1], 0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer saved beside it (read from the folder in
    each of the CLI's evaluations, not parsed from the GGUF file again; `model.tokenizer` is
    tested in test_eval)."""
    return build_agent(tmp_path_factory.mktemp("tiny_gate_llama"))


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_cli_gate_on_a_tiny_model(tiny, tmp_path, monkeypatch, capsys):
    from car_jax import cli

    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))  # the default world index
    out = tmp_path / "gate"
    argv = ["eval", "--gate", "0.5", f"model.path={tiny}", "data.limit=4",
            "batch_size=4", "episode.max_turns=1", "episode.max_response_tokens=6", "episode.max_obs_tokens=16",
            "output.n_boot=20", f"output.dir={out}"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "confidence-gated search" in printed and "gate 0.5" in printed and "TAU" in printed
    direct, search = _lines(out / "direct" / "samples.jsonl"), _lines(out / "search" / "samples.jsonl")
    assert [r["mode"] for r in direct] == ["direct"] * 4 and [r["mode"] for r in search] == ["search"] * 4
    result = json.loads((out / "gate.json").read_text())
    gated = _lines(out / "samples.jsonl")
    assert [r["id"] for r in gated] == [r["id"] for r in direct]
    use_tool = [d["confidence"] < 0.5 for d in direct]
    expect = [s if t else d for d, s, t in zip(direct, search, use_tool)]
    assert [g["correct"] for g in gated] == [e["correct"] for e in expect]
    assert [g["confidence"] for g in gated] == [e["confidence"] for e in expect]
    calls = [s["n_tool_calls"] if t else 0 for s, t in zip(search, use_tool)]
    assert result["summary"]["mean_tool_calls"] == pytest.approx(np.mean(calls))
    assert result["summary"]["accuracy"] == pytest.approx(np.mean([e["correct"] for e in expect]))
    assert result["summary"]["gated_rate"] == pytest.approx(np.mean(use_tool))
    row0 = next(r for r in result["curve"] if r["tau"] == 0.0)  # TAU 0 is the direct agent
    assert row0["accuracy"] == pytest.approx(result["direct"]["accuracy"]) and row0["tool_calls"] == 0
    assert (out / "gate.png").read_bytes()[:4] == b"\x89PNG"

    # again: both evaluations resume (nothing re-runs) and give the same gate
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert json.loads((out / "direct" / "summary.json").read_text())["run"]["new_examples"] == 0
    assert json.loads((out / "gate.json").read_text())["summary"]["accuracy"] == result["summary"]["accuracy"]

    assert cli.main(["eval", "--gate", "0.5", "mode=direct", f"output.dir={tmp_path / 'x'}"]) == 2
    assert "needs a tool mode" in capsys.readouterr().err
    assert cli.main(["eval", "--gate", "80", f"output.dir={tmp_path / 'x'}"]) == 2
    assert "pass 0.8" in capsys.readouterr().err
