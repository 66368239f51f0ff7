"""The pilot's mixed kind (one policy, both tools): a scripted study on world-large mixed_dev
whose cells, per-tool parts and Welch tests are re-derived from the per-example files (numpy,
sklearn and scipy, the bootstrap from the same resample indices), and its config keys."""
import json

import numpy as np
import pytest
import scipy.stats

import car_jax.eval.runner as ev
from car_jax.config import load_config
from car_jax.data import TEMPLATES, QAExample, load_dataset
from car_jax.eval import pilot
from car_jax.rollout.protocols import Mixed
from car_jax.rollout.episode import Trajectory
from tests.test_pilot import _bootstrap, _fake_models, _numpy_metrics, cache  # noqa: F401 - cache: the car_jax cache fixture

N = 12
RULES = {  # setting -> (is example i answered right, its confidence 0..100); both parts get both classes
    "direct": lambda i: (i % 3 == 0, 55 + (7 * i) % 40),
    "prompt": lambda i: (i % 4 < 2, 90 - 5 * (i % 3)),
    "rl": lambda i: (i % 6 not in (3, 4), 85 if i % 6 not in (3, 4) else 20 + (7 * i) % 30),
}


def _script(examples):
    """A stand-in for run_episodes: answers and confidences follow RULES by the prompt's
    setting (system message, or the rl model) and the example's index; records what each
    call was given (protocol, tools)."""
    lookup = {e.question: (i, e) for i, e in enumerate(examples)}
    calls = []

    def fake(model, tokenizer, prompts, tools=None, protocol=None, **kwargs):
        calls.append((type(protocol).__name__, sorted(tools or {}), prompts[0][0]["content"]))
        out = []
        for prompt in prompts:
            i, ex = lookup[prompt[-1]["content"].split(": ", 1)[1]]
            direct = prompt[0]["content"] == TEMPLATES["direct"].system
            setting = "rl" if model.tag == "rl" else "direct" if direct else "prompt"
            right, conf = RULES[setting](i)
            answer = ex.golden_answers[0] if right else ("-1" if ex.task == "math" else "no idea")
            text = f"<think> t </think>\n<answer> {answer} </answer>\n<confidence> {conf} </confidence>"
            t = Trajectory(prompt_ids=[1])
            t.text, t.pieces, t.n_turns, t.n_tool_calls, t.answered = text, [(text, True)], 1, int(not direct), True
            out.append(t)
        return out

    return fake, calls


def test_scripted_mixed_cells_and_parts_rederived(cache, tmp_path, monkeypatch):
    examples = load_dataset("world-large", split="mixed_dev", limit=N)
    calls = _fake_models(monkeypatch, tmp_path, *_script(examples))
    cfg = load_config(pilot.PilotConfig, None, [
        "kinds=[mixed]", "model.path=base", f"mixed_checkpoint={tmp_path / 'rl'}", f"mixed_data.limit={N}",
        "tools.retriever=world", "batch_size=5", "n_boot=50", "seed=3", f"out={tmp_path / 'pilot'}"])
    result = pilot.run_pilot(cfg, log=lambda _: None, progress=False)
    on_disk = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    # the prompt and rl cells ran the mixed prompt and protocol with both tools; direct none
    assert {(p, tuple(t)) for p, t, s in calls if s == TEMPLATES["mixed"].system} == {("Mixed", ("code", "search"))}
    assert {(p, tuple(t)) for p, t, s in calls if s == TEMPLATES["direct"].system} == {("SearchR1", ())}
    cells = on_disk["cells"]["mixed"]
    assert list(on_disk["cells"]) == ["mixed"] and list(cells) == ["direct", "prompt", "rl"]
    assert [c["mode"] for c in cells.values()] == ["direct", "mixed", "mixed"]
    part_of = ["search" if e.task == "qa" else "code" for e in examples]
    assert part_of == [e.meta["tool"] for e in examples] == ["search", "code"] * (N // 2)
    values = {}
    for setting, cell in cells.items():
        samples = tmp_path / "pilot" / "mixed" / setting / "samples.jsonl"
        rows = [json.loads(x) for x in samples.read_text().splitlines()]
        assert [r["id"] for r in rows] == [e.id for e in examples]
        c = np.array([r["correct"] for r in rows], float)
        q = np.array([r["confidence"] for r in rows], float)
        assert c.tolist() == [RULES[setting](i)[0] for i in range(N)], setting  # the script's answers, scored
        assert q == pytest.approx([RULES[setting](i)[1] / 100 for i in range(N)])
        groups = {"mixed": np.arange(N), **{f"mixed/{p}": np.flatnonzero(np.array(part_of) == p) for p in pilot.PARTS}}
        for group, idx in groups.items():
            numbers = cell if group == "mixed" else cell["by_tool"][group.split("/")[1]]
            want, boot = _numpy_metrics(c[idx], q[idx]), _bootstrap(c[idx], q[idx], 50, seed=3)
            assert numbers["n"] == len(idx)
            assert numbers["format_rate"] == pytest.approx(np.mean([rows[i]["format_ok"] for i in idx]))
            for name in pilot.METRICS:
                assert numbers[name] == pytest.approx(want[name], abs=1e-6), (setting, group, name)
                assert numbers["ci95"][name] == pytest.approx(boot[name], abs=1e-5), (setting, group, name)
            values[group, setting] = (c[idx], q[idx])
    # Welch tests for the kind and for each part, every pair of settings, against scipy
    assert len(on_disk["tests"]) == 3 * 3 * 3
    assert [t["kind"] for t in on_disk["tests"]][::9] == ["mixed", "mixed/search", "mixed/code"]
    for t in on_disk["tests"]:
        (ca, qa), (cb, qb) = values[t["kind"], t["a"]], values[t["kind"], t["b"]]
        a, b = {"correct": (ca, cb), "calib_error": (abs(qa - ca), abs(qb - cb)),
                "wrong_confidence": (qa[ca == 0], qb[cb == 0])}[t["quantity"]]
        want = scipy.stats.ttest_ind(a, b, equal_var=False)
        assert t["t"] == pytest.approx(want.statistic, rel=1e-6) and t["p"] == pytest.approx(want.pvalue, rel=1e-6)
    table = pilot.format_pilot(result)
    assert "mixed/search  prompt" in table and "mixed/code    rl" in table
    assert (tmp_path / "pilot" / "pilot.png").read_bytes()[:4] == b"\x89PNG"
    assert pilot.groups(result["cells"]).keys() == {"mixed", "mixed/search", "mixed/code"}


def test_mixed_config_keys(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = load_config(pilot.PilotConfig, None, ["kinds=[evidence,mixed]", f"checkpoint={tmp_path / 'a'}",
                                                f"mixed_checkpoint={tmp_path / 'b'}"])
    cells = pilot.cell_configs(cfg)
    assert cells["mixed", "rl"].model.path == str(tmp_path / "b")
    assert cells["evidence", "rl"].model.path == str(tmp_path / "a")
    assert (cells["mixed", "prompt"].data.path, cells["mixed", "prompt"].data.split) == ("world-large", "mixed_dev")
    shared = pilot.cell_configs(load_config(pilot.PilotConfig, None, ["kinds=[mixed]", f"checkpoint={tmp_path / 'a'}"]))
    assert shared["mixed", "rl"].model.path == str(tmp_path / "a")  # no mixed_checkpoint: the shared one
    assert pilot.PilotConfig().kinds == ("evidence", "verification")  # the mixed kind is opt-in
    missing = load_config(pilot.PilotConfig, None, ["kinds=[mixed]", f"mixed_checkpoint={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="mixed_checkpoint=.*nope.*no such file"):
        pilot.cell_configs(missing)
    odd = QAExample("x", "q?", ("a",), "s", "x", meta={"tool": "web"})
    with pytest.raises(ValueError, match="tool 'web'"):
        pilot.tool_parts([odd], [{}])
    assert type(ev.get_mode("mixed").protocol()) is Mixed
