"""The eval tables' honesty marks: metrics of a column whose format-valid rate is below 0.5
are marked as fallback values with one note under the table (`runner.format_table`,
`runner.compare_table`, `pilot.format_pilot`, the experiment's RESULTS.md policy table), and
the single-run table defines its model turns. Hand-made records only: no model."""
import pytest

import car_jax.eval.runner as ev
from car_jax.eval import pilot
from car_jax.experiment import markdown, stats

MARK, NOTE = ev.FALLBACK_MARK, ev.FALLBACK_NOTE


def _records(n: int, correct: float, q: float, format_ok: float, turns: int = 3, sampled_format: float | None = None):
    """n records: the first round(correct n) right, confidence q, the first round(format_ok n)
    well formed; with `sampled_format`, two sampled episodes each, that share well formed."""
    out = []
    for i in range(n):
        ok = i < round(format_ok * n)
        rec = {"correct": i < round(correct * n), "confidence": q if ok else 0.0, "confidence_ok": ok,
               "format_ok": ok, "answered": ok, "n_turns": turns, "n_tool_calls": turns - 1}
        if sampled_format is not None:
            rec["sampled"] = [{"answer": "a", "correct": bool(j), "confidence": 0.5, "confidence_ok": True,
                               "format_ok": i < round(sampled_format * n), "n_turns": 1, "n_tool_calls": 0}
                              for j in range(2)]
        out.append(rec)
    return out


def _summary(records, max_turns: int = 2) -> dict:
    return {"mode": "search", **ev.summarize(records, n_boot=0), "run": {"episode": {"max_turns": max_turns}}}


@pytest.fixture(scope="module")
def first_eval():
    """The embedded base model's first evaluation: no response parses, so every one is wrong at q = 0."""
    return _summary(_records(8, correct=0.0, q=0.0, format_ok=0.0))


@pytest.fixture(scope="module")
def good_eval():
    return _summary(_records(8, correct=0.5, q=0.7, format_ok=0.75))


def _row(table: str, label: str) -> str:
    [line] = [line for line in table.splitlines() if line.startswith(label + "  ")]
    return line[len(label):].strip()


def test_format_table_marks_fallback_metrics_and_says_why(first_eval):
    table = ev.format_table(first_eval)
    for label in ("accuracy", "ECE", "Brier", "mean confidence"):
        assert _row(table, label) == f"0.000{MARK}", label
    assert _row(table, "format valid") == "0.000"  # the reason, not a fallback value
    assert table.splitlines().count(NOTE) == 1
    assert "without an <answer>" in NOTE and "q = 0" in NOTE and "ECE and Brier 0" in NOTE


def test_format_table_of_a_well_formed_run_has_no_mark(good_eval):
    table = ev.format_table(good_eval)
    assert _row(table, "accuracy") == "0.500" and MARK not in table and NOTE not in table


def test_format_rate_of_one_half_is_not_a_fallback():
    assert not ev.is_fallback(0.5) and ev.is_fallback(0.49) and not ev.is_fallback(None)
    assert not ev.is_fallback(float("nan"))
    assert NOTE not in ev.format_table(_summary(_records(8, correct=0.5, q=0.7, format_ok=0.5)))


def test_format_table_defines_model_turns(first_eval):
    """max_turns counts tool turns; an episode that never answers also writes the answer-only
    turn after them, so 3 model turns with max_turns = 2 is the most there can be."""
    table = ev.format_table(first_eval)
    assert _row(table, "mean model turns") == "3.000" and "mean turns" not in table
    assert table.splitlines()[-1] == ev.turns_note(first_eval)
    assert "at most max_turns + 1 = 3" in table
    no_run = {k: v for k, v in first_eval.items() if k != "run"}
    assert ev.format_table(no_run).endswith("at most max_turns + 1")


def test_sampled_and_kind_rows_are_marked_by_their_own_format_rate():
    recs = _records(8, correct=0.5, q=0.7, format_ok=1.0, sampled_format=0.25)
    for i, r in enumerate(recs):
        r["kind"] = "hard" if i < 4 else "easy"
        r["format_ok"] = i >= 4  # the hard kind's responses all break the format
    summary = _summary(recs)
    table = ev.format_table(summary)
    assert MARK not in _row(table, "accuracy")  # 0.5 format valid over all
    sampled = table[table.index("sampled episodes"):]
    assert _row(sampled, "  format valid") == "0.250" and _row(sampled, "  ECE").endswith(MARK)
    assert _row(table, "  hard (n=4)").endswith(f"{MARK}") and MARK not in _row(table, "  easy (n=4)")
    assert NOTE in table.splitlines()


def test_compare_table_marks_each_fallback_column(first_eval, good_eval):
    lines = ev.compare_table({"base": first_eval, "CAR": good_eval}).splitlines()
    rows = {" ".join(line.split()[:-3]): line.split()[-3:] for line in lines[2:] if len(line.split()) >= 4}
    assert rows["accuracy"] == [f"0.000{MARK}", "0.500", f"+0.500{MARK}"]
    assert rows["format valid"] == ["0.000", "0.750", "+0.750"]
    assert rows["mean tool calls"] == ["2.000", "2.000", "+0.000"]
    assert lines[-1] == NOTE and lines.count(NOTE) == 1
    assert NOTE not in ev.compare_table({"base": good_eval, "CAR": good_eval})


def _pilot_cell(format_rate: float) -> dict:
    nums = {m: 0.25 for m in pilot.METRICS}
    return {"n": 8, **nums, "ci95": {m: [0.1, 0.4] for m in pilot.METRICS}, "mean_confidence": 0.5,
            "mean_tool_calls": 1.0, "format_rate": format_rate}


def test_pilot_table_marks_its_fallback_cells():
    result = {"cells": {"evidence": {"direct": _pilot_cell(0.1), "prompt": _pilot_cell(0.9)}}, "tests": []}
    lines = pilot.format_pilot(result).splitlines()
    [direct] = [line for line in lines if line.startswith("evidence  direct")]
    [prompt] = [line for line in lines if line.startswith("evidence  prompt")]
    assert direct.count(f"0.250{MARK} [0.100, 0.400]") == 4 and MARK not in prompt
    assert lines.count(NOTE) == 1
    result["cells"]["evidence"]["direct"] = _pilot_cell(0.6)
    assert NOTE not in pilot.format_pilot(result)


def test_experiment_policy_table_marks_fallback_policies():
    def policy(format_ok: float):
        recs = [{"correct": i % 2 == 0, "confidence": 0.6, "format_ok": i < round(format_ok * 8)} for i in range(8)]
        return stats.arm_summary([{"records": recs, "summary": {}}], n_boot=20, seed=0)

    warm, car = policy(0.25), policy(1.0)
    assert warm["format_rate"] == [0.25] and car["format_rate"] == [1.0]
    lines = markdown._policy_table({"policies": {"warm": warm, "car": car}})
    assert lines[0].endswith("| format valid |")
    [warm_row] = [line for line in lines if line.startswith("| warm start")]
    [car_row] = [line for line in lines if line.startswith("| car (1 seed)")]
    assert warm_row.count("\\" + MARK) == 6 and warm_row.endswith("| 0.250 |")
    assert "\\" + MARK not in car_row and car_row.endswith("| 1.000 |")
    assert lines[-1] == markdown.NOTE and markdown.NOTE.startswith("\\" + MARK) and "`<answer>`" in markdown.NOTE
    assert markdown.NOTE not in markdown._policy_table({"policies": {"car": car}})
    # records without format_ok (older folders): no rate, no mark
    old = stats.arm_summary([{"records": [{"correct": i % 2 == 0, "confidence": 0.5} for i in range(4)],
                               "summary": {}}], n_boot=20)
    assert old["format_rate"] == [None] and markdown._policy_table({"policies": {"x": old}})[-1].endswith("| n/a |")
