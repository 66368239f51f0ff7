"""The positive control (car_jax.experiment.control): its targets, its exact measurement of
E[q | kind], its report, and (in `test_trainer_learns_the_known_confidence`) the real trainer
learning the confidence each kind deserves where the binary reward does not."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from car_jax.data import chance
from car_jax.experiment import control


def test_targets_are_the_rewards_maximisers():
    """q*(p) is the argmax of each arm's expected reward, found on a grid (numpy)."""
    grid = np.linspace(0.0, 1.0, 100_001)
    for arm in (control.ARMS["brier"], control.ARMS["mscr"], control.ARMS["mscr_b2_3"], control.ARMS["mscr_b1_2"]):
        for _, p in chance.KINDS:
            if arm.kind == "brier":
                expected = p * (1 - (1 - grid) ** 2) + (1 - p) * (0 - grid ** 2)
            else:
                expected = p * (1 + arm.b1 * (1 - (1 - grid) ** 2)) - (1 - p) * arm.b2 * grid ** 2
            assert abs(grid[np.argmax(expected)] - arm.target(p)) < 1e-4
    assert control.ARMS["mscr_b2_3"].target(0.5) == pytest.approx(0.25)
    assert control.ARMS["mscr_b1_2"].target(0.5) == pytest.approx(2 / 3)
    assert "reward.b1=2.0" in control.ARMS["mscr_b1_2"].overrides


def test_measure_reads_the_value_distribution(monkeypatch):
    """measure: per kind, E[q] = sum_v P(v) v / 100, the mode, and P(v < 10), re-derived
    with numpy from a scripted distribution over 0..100, and P(answer) as given."""
    rng = np.random.default_rng(3)
    dist = rng.dirichlet(np.full(101, 0.3), size=len(chance.KINDS))
    answers = rng.uniform(size=len(chance.KINDS))
    monkeypatch.setattr(control, "kind_prefixes", lambda tokenizer, kinds: [[1]] * len(kinds))
    monkeypatch.setattr(control, "value_distribution", lambda model, tokenizer, prefixes, tail: dist)
    monkeypatch.setattr(control, "answer_probability", lambda model, tokenizer, kinds: answers)
    got = control.measure(None, None)
    for (kind, _), d, a in zip(chance.KINDS, dist, answers):
        assert got[kind]["answers"] == a
        assert got[kind]["expected_q"] == pytest.approx(float(d @ np.arange(101)) / 100, abs=1e-12)
        assert got[kind]["mode"] == int(np.argmax(d)) / 100
        assert got[kind]["one_digit"] == pytest.approx(float(d[:10].sum()), abs=1e-12)
        np.testing.assert_allclose(got[kind]["distribution"], d, atol=1e-7)


def test_answer_probability_equals_transformers(tmp_path):
    """P(the policy writes "<answer> KIND </answer>\n<confidence>" after the kind's prompt),
    re-derived from a tiny random llama in torch (transformers' logits, log-softmax, the
    response tokens' log-probs summed). Compared as log-probabilities: a random 49k-token
    model gives each response about e^-100, and float32 logits from two frameworks differ by
    about 1e-5 per token, so the summed logs agree to 1e-3 where the probabilities' relative
    difference is the same 1e-3."""
    import torch

    from car_jax.assets import smollm2_gguf
    from car_jax.loading import load_model, load_tokenizer
    from tests.hf_factory import build

    tok = load_tokenizer(smollm2_gguf())
    hf = build("llama", tmp_path, vocab_size=len(tok), initializer_range=0.2)
    got = control.answer_probability(load_model(tmp_path, progress=False), tok)
    parts = control.kind_parts(tok)
    assert got.shape == (len(chance.KINDS),)
    for (prompt, response), (kind, _), p in zip(parts, chance.KINDS, got):
        assert tok.decode(response) == f"<answer> {kind} </answer>\n<confidence>"
        assert f"Coin:{(' ' + kind) * 8}" in tok.decode(prompt)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        want = float(logp[torch.arange(len(response)), torch.tensor(response)].sum())
        assert np.log(p) == pytest.approx(want, abs=1e-3)


def test_answer_probability_of_a_model_that_always_answers_one_kind():
    """A stub model whose logits put all mass on the jade response's tokens, whatever comes
    before: P(answer) is 1 for jade and 0 for the kinds whose answer differs in a token."""
    from car_jax.assets import smollm2_gguf
    from car_jax.loading import load_tokenizer

    tok = load_tokenizer(smollm2_gguf())
    parts = control.kind_parts(tok)
    jade = dict(zip([k for k, _ in chance.KINDS], parts))["jade"][1]

    class Stub:
        def logits(self, tokens):
            out = np.full((*tokens.shape, len(tok)), -1e4, np.float32)
            for row, (prompt, _) in enumerate(parts):  # each position predicts the jade response's next token
                for i, t in enumerate(jade):
                    out[row, len(prompt) - 1 + i, t] = 0.0
            return out

    got = dict(zip([k for k, _ in chance.KINDS], control.answer_probability(Stub(), tok)))
    assert got["jade"] == pytest.approx(1.0) and all(v < 1e-100 for k, v in got.items() if k != "jade")


def test_arms_run_no_sft_and_their_schedule_spans_the_run(tmp_path):
    """An sft override sets the warm start's SFT alone; an arm's cosine runs over all of its
    optimizer updates (steps x prompts x G / mini_batch x epochs), whatever the overrides."""
    over = ["sft.steps=123", "rl.prompts_per_step=6", "rl.mini_batch=16", "rl.epochs=2"]
    warm = control.warm_config(tmp_path, 3, over)
    arm = control.arm_config(tmp_path, control.ARMS["mscr"], 3, 7, over)
    assert warm.sft.steps == 123 and warm.rl.steps == 0
    assert arm.sft.steps == 0 and arm.rl.steps == 7
    assert arm.rl.optim.total_steps == 7 * (6 * 16 // 16) * 2  # G = 16 in the design
    assert arm.model.path == str(tmp_path / "warm-s3" / "hf") and arm.reward.kind == "mscr"
    assert arm.rl.optim.schedule == "cosine"


def test_an_arm_with_its_own_batch_keeps_the_number_of_updates(tmp_path):
    """mscr_wide: 25 prompts a step in mini-batches of 100, so the same 4 optimizer updates a
    step as the design's 10 prompts in 40s, each over 2.5x the trajectories; the schedule spans
    them; its reward is MSCR's; a command-line override still wins over the arm's batch."""
    base = control.arm_config(tmp_path, control.ARMS["mscr"], 0, 9)
    wide = control.arm_config(tmp_path, control.ARMS["mscr_wide"], 0, 9)
    assert (base.rl.prompts_per_step, base.rl.mini_batch) == (10, 40)
    assert (wide.rl.prompts_per_step, wide.rl.mini_batch) == (25, 100)
    g = wide.rollout.group_size
    assert wide.rl.optim.total_steps == base.rl.optim.total_steps == 9 * (25 * g // 100)
    assert (wide.reward.kind, wide.reward.b1, wide.reward.b2) == ("mscr", 1.0, 1.0)
    assert wide.run.dir == str(tmp_path / "mscr_wide-s0")
    mine = control.arm_config(tmp_path, control.ARMS["mscr_wide"], 0, 9, ["rl.mini_batch=200"])
    assert mine.rl.mini_batch == 200 and mine.rl.optim.total_steps == 9 * 2


@pytest.mark.parametrize("split, over, steps, lr", [
    ("train", [], 1200, 5e-4), ("extremes", [], 60, 1e-3), ("train", ["rl.optim.lr=2e-4"], 1200, 2e-4)])
def test_each_split_runs_its_budget(tmp_path, monkeypatch, split, over, steps, lr):
    """run_control without steps runs the split's budget (steps, peak lr); an lr override wins."""
    ran = []
    monkeypatch.setattr(control, "train", ran.append)
    monkeypatch.setattr(control, "_measure_unit", lambda run_dir: {})
    control.run_control(tmp_path, arms=["brier"], seeds=[0], split=split, overrides=over, log=lambda _: None)
    warm, arm = ran
    assert warm.rl.steps == 0 and arm.rl.steps == steps and arm.rl.optim.lr == pytest.approx(lr)
    assert arm.data.train_split == split and arm.rl.optim.total_steps == steps * 4  # 160 rows / 40 a mini-batch


def _unit(folder, values, steps=3, one_digit=None, answers=None):
    folder.mkdir(parents=True)
    extra = lambda k: {**({} if one_digit is None else {"one_digit": one_digit[k]}),  # noqa: E731
                       **({} if answers is None else {"answers": answers[k]})}
    (folder / control.UNIT_FILE).write_text(json.dumps({k: {"expected_q": v, "mode": v, **extra(k)}
                                                        for k, v in values.items()}))
    rows = [{"step": s, **{f"q/chance-{k}": v * s / steps for k, v in values.items()}} for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_reads_the_units(tmp_path):
    """Errors are the mean over kinds of |E[q | kind] - q*| (re-derived here); an arm learns
    when every seed is within the tolerance; a missing seed leaves the verdict open."""
    ps = dict(chance.KINDS)
    good = {k: p + 0.05 for k, p in ps.items()}  # error 0.05
    flat = {k: 0.5 for k in ps}  # error mean |0.5 - p| = 0.24
    for s in (0, 1):
        _unit(tmp_path / f"warm-s{s}", flat)
        _unit(tmp_path / f"brier-s{s}", good)
        _unit(tmp_path / f"binary-s{s}", flat)
    _unit(tmp_path / "mscr-s0", good)
    rep = control.report(tmp_path, arms=["brier", "binary", "mscr"], seeds=[0, 1])
    assert rep["arms"]["brier"]["error"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.05)}
    assert rep["arms"]["binary"]["error"]["0"] == pytest.approx(np.mean([abs(0.5 - p) for p in ps.values()]))
    assert rep["arms"]["brier"]["learned"] is True and rep["arms"]["binary"]["learned"] is False
    assert rep["arms"]["mscr"]["learned"] is None  # seed 1 missing
    want = {k: np.mean([v * s / 3 for s in range(1, 4)][-1:]) for k, v in good.items()}  # last step: v
    assert {k: c[-1] for k, c in rep["arms"]["brier"]["curve"].items()} == pytest.approx(want)
    table = (tmp_path / control.TABLE_FILE).read_text()
    assert "| brier |" in table and "2 of 2" in table and "0 of 2" in table
    assert (tmp_path / control.PLOT_FILE).stat().st_size > 0
    assert json.loads((tmp_path / control.REPORT_FILE).read_text())["arms"]["brier"]["learned"] is True


def test_report_names_the_kinds_held_in_one_digit(tmp_path):
    """A kind whose q* is above 0.1 but whose policy puts >= half its mass on values 0..9 (at
    most 0.09) is named under the table (seed by seed); one with q* <= 0.1 (MSCR b2 = 3's
    amber, 0.036; Brier's amber, 0.1) is not, nor is the binary arm; units measured without it
    are left out."""
    ps = dict(chance.KINDS)
    b23 = control.ARMS["mscr_b2_3"]
    low = {k: 0.05 for k in ps}
    held = {"amber": 0.99, "cobalt": 0.9, "jade": 0.5, "silver": 0.49, "slate": 0.0}
    _unit(tmp_path / "mscr_b2_3-s0", low, one_digit=held)
    _unit(tmp_path / "mscr_b2_3-s1", low)  # measured before the key existed
    _unit(tmp_path / "binary-s0", low, one_digit=held)
    _unit(tmp_path / "brier-s0", low, one_digit={**{k: 0.0 for k in ps}, "amber": 1.0})
    rep = control.report(tmp_path, arms=["mscr_b2_3", "binary", "brier"], seeds=[0, 1])
    assert b23.target(ps["amber"]) < 0.1 <= b23.target(ps["cobalt"])
    assert rep["arms"]["mscr_b2_3"]["one_digit"] == {"0": held}
    table = (tmp_path / control.TABLE_FILE).read_text()
    assert "mscr_b2_3 seed 0: cobalt, jade." in table
    assert "binary seed" not in table and "brier seed" not in table and "seed 1:" not in table


def test_a_seed_that_lost_a_kinds_format_does_not_pass(tmp_path):
    """E[q | kind] is measured after the answer naming the kind: a seed whose policy writes
    that answer for some kind with probability below ANSWER_MIN fails, however near q* its
    E[q | kind] is, and the table names the kind; a seed measured before P(answer) existed
    is decided by its error and listed as unchecked."""
    ps = dict(chance.KINDS)
    good = {k: p + 0.02 for k, p in ps.items()}
    kept = {k: 0.97 for k in ps}
    _unit(tmp_path / "brier-s0", good, answers=kept)
    _unit(tmp_path / "brier-s1", good, answers={**kept, "silver": control.ANSWER_MIN - 1e-3})
    _unit(tmp_path / "brier-s2", good)
    _unit(tmp_path / "mscr-s0", good, answers={**kept, "amber": control.ANSWER_MIN})  # at the bound: kept
    rep = control.report(tmp_path, arms=["brier", "mscr"], seeds=[0, 1, 2])
    brier = rep["arms"]["brier"]
    assert brier["error"]["1"] == pytest.approx(0.02) and brier["lost"] == {"0": [], "1": ["silver"]}
    assert brier["passed"] == {"0": True, "1": False, "2": True} and brier["learned"] is False
    assert rep["arms"]["mscr"]["passed"] == {"0": True} and rep["arms"]["mscr"]["learned"] is None
    table = (tmp_path / control.TABLE_FILE).read_text()
    assert "brier seed 1: silver (0.499)" in table and "brier seed 0:" not in table
    assert "| 0: 0.020, 1: 0.020, 2: 0.020 | 2 of 3 |" in table  # the errors named by seed
    assert "format not checked, the error alone decides): brier (seed 2)." in table


def test_report_pairs_the_arms_by_seed(tmp_path):
    """Seed-paired differences of the errors, re-derived with scipy: each arm against binary,
    and an arm whose q* is not p against its own error measured from p."""
    from scipy import stats as ss

    ps = dict(chance.KINDS)
    b23 = control.ARMS["mscr_b2_3"]
    shifts = {0: 0.02, 1: -0.04, 2: 0.07}
    for s, d in shifts.items():
        _unit(tmp_path / f"warm-s{s}", {k: 0.5 for k in ps})
        _unit(tmp_path / f"brier-s{s}", {k: min(p + d, 1.0) for k, p in ps.items()})
        _unit(tmp_path / f"binary-s{s}", {k: 0.5 + d for k in ps})
    for s in (0, 1):  # seed 2 missing: pairs over seeds 0 and 1 only
        _unit(tmp_path / f"mscr_b2_3-s{s}", {k: b23.target(p) + 0.03 * (s + 1) for k, p in ps.items()})
    rep = control.report(tmp_path, arms=["brier", "binary", "mscr_b2_3"], seeds=[0, 1, 2])

    def err(values, ref):
        return float(np.mean([abs(values[k] - ref[k]) for k in ps]))

    brier = [err({k: min(p + d, 1.0) for k, p in ps.items()}, ps) for d in shifts.values()]
    binary = [err({k: 0.5 + d for k in ps}, ps) for d in shifts.values()]
    got = rep["arms"]["brier"]["paired"]["binary"]
    want = ss.ttest_rel(brier, binary)
    half = ss.t.ppf(0.975, 2) * np.std(np.subtract(brier, binary), ddof=1) / np.sqrt(3)
    assert got["seeds"] == ["0", "1", "2"] and got["mean"] == pytest.approx(np.mean(np.subtract(brier, binary)))
    assert got["p"] == pytest.approx(want.pvalue) and got["hi"] - got["mean"] == pytest.approx(half)
    assert "p" not in rep["arms"]["brier"]["paired"]  # Brier's q* is p
    own = rep["arms"]["mscr_b2_3"]["paired"]
    b23_values = [{k: b23.target(p) + 0.03 * (s + 1) for k, p in ps.items()} for s in (0, 1)]
    vs_p = [err(v, ps) for v in b23_values]
    assert own["binary"]["seeds"] == ["0", "1"] and own["p"]["per_seed"] == pytest.approx(
        [0.03 * (s + 1) - e for s, e in zip((0, 1), vs_p)])
    assert own["p"]["mean"] < 0  # nearer its own optimum than p
    assert "binary" not in rep["arms"]["binary"]["paired"]
    table = (tmp_path / control.TABLE_FILE).read_text()
    assert "| brier - binary | 0, 1, 2 |" in table and "| mscr_b2_3: error against q* - against p | 0, 1 |" in table


def _error(values: dict, arm: "control.Arm", kinds) -> float:
    """mean over `kinds` of |E[q | kind] - q*|, written out again (numpy)."""
    return float(np.mean([abs(values[k]["expected_q"] - arm.target(p)) for k, p in kinds]))


def test_trainer_learns_the_known_confidence(tmp_path):
    """The control's quick version through the real trainer, run as a user runs it
    (`car-jax control --quick` in its own process, with XLA's default flags rather than this
    suite's -O0 and full-precision matmuls): the two extreme kinds (p = 0.1 and 0.9), one seed.
    From a warm start that states the same random confidences for both, Brier GRPO reaches
    E[q | kind] within the control's tolerance of p for both; the binary reward, from the same
    warm start with the same prompts and coin tosses, does not come near, and neither does
    the untrained warm start.

    Bounds: in results/control_extremes_g16 (this design, 5 seeds) Brier's error was
    0.020-0.079 with a spread (slate - amber) of 0.68-0.87, binary's error 0.215-0.410 and
    the warm starts' 0.36-0.43 with spreads of at most 0.08."""
    kinds = chance.KINDS[:2]
    assert sorted(p for _, p in kinds) == [0.1, 0.9] and chance.split_kinds(control.QUICK_SPLIT) == kinds
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "car_jax.cli", "control", "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {name: json.loads((tmp_path / f"{name}-s0" / control.UNIT_FILE).read_text())
           for name in ("warm", "brier", "binary")}
    brier, binary = control.ARMS["brier"], control.ARMS["binary"]
    spread = {n: got[n]["slate"]["expected_q"] - got[n]["amber"]["expected_q"] for n in got}
    assert _error(got["brier"], brier, kinds) <= control.TOLERANCE and spread["brier"] >= 0.55, got["brier"]
    assert _error(got["warm"], brier, kinds) >= 0.3 and abs(spread["warm"]) <= 0.1, got["warm"]
    assert _error(got["binary"], binary, kinds) >= 0.15, got["binary"]
    assert all(got["brier"][k]["answers"] >= control.ANSWER_MIN for k, _ in kinds), got["brier"]  # format kept
    rep = json.loads((tmp_path / control.REPORT_FILE).read_text())
    assert rep["arms"]["brier"]["error"]["0"] == pytest.approx(_error(got["brier"], brier, kinds))
    assert rep["arms"]["brier"]["learned"] is True and rep["arms"]["binary"]["learned"] is False
    assert "brier: learns q* in every seed" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "brier-s0" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == control.QUICK_STEPS and {"q/chance-amber", "q/chance-slate"} <= set(rows[-1])
    assert (tmp_path / control.PLOT_FILE).stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["control", "--arms", "brier,nope"], "--arms: unknown arm 'nope'"),
    (["control", "--split", "all"], "--split: 'all' is not one of train, dev, extremes"),
    (["control", "--steps", "0"], "--steps: 0 must be >= 1"),
])
def test_cli_refuses_bad_arguments_in_one_line(argv, message, capsys, tmp_path):
    from car_jax.cli import main

    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"car-jax control: error: {message}") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # nothing ran


def test_an_arm_refuses_a_warm_start_without_weights(tmp_path, monkeypatch):
    """Committed records keep a warm start's config.json but not its weights: an arm that still
    has to train says which folder to remove, before any training starts."""
    warm = tmp_path / "warm-s0"
    (warm / "hf").mkdir(parents=True)
    (warm / "hf" / "config.json").write_text("{}")
    (warm / "last_step.json").write_text(json.dumps({"step": 0}))
    (warm / control.UNIT_FILE).write_text("{}")
    monkeypatch.setattr(control, "train", lambda cfg: pytest.fail(f"trained {cfg.run.dir}"))
    with pytest.raises(FileNotFoundError, match=r"warm-s0 has its records but not its weights.*remove .*warm-s0"):
        control.run_control(tmp_path, arms=["brier"], seeds=[0], log=lambda line: None)
