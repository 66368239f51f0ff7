"""Reward functions: hand-worked values, MSCR properties, configs, and the text -> arrays glue."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from car_jax.calibration import rewards

Q = np.array([0.0, 0.3, 1.0], np.float32)
ALL_OK = np.ones(3, bool)
NONE_OK = np.zeros(3, bool)

# Hand-worked from the formulas, q = 0, 0.3, 1 (see the comments for the arithmetic).
HAND = {
    # R = c
    "binary": ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]),
    # c=1: 1 - (q-1)^2 = 1-1, 1-0.49, 1-0 ; c=0: -q^2 = 0, -0.09, -1
    "brier": ([0.0, 0.51, 1.0], [0.0, -0.09, -1.0]),
    # w = 0.5: c=1: 1 - 0.5, 1 - 0.245, 1 ; c=0: 0, -0.045, -0.5
    "weighted_brier": ([0.5, 0.755, 1.0], [0.0, -0.045, -0.5]),
    # b1=b2=1: c=1: 1 + (1 - (1-q)^2) = 1 + 0, 1 + 0.51, 1 + 1 ; c=0: -q^2
    "mscr": ([1.0, 1.51, 2.0], [0.0, -0.09, -1.0]),
}
TOL = dict(rtol=0, atol=1e-6)  # float32 arithmetic on numbers of size <= 2


@pytest.mark.parametrize("kind", sorted(HAND))
def test_hand_values_default_config(kind):
    fn = rewards.reward_fn(rewards.RewardConfig(kind=kind))
    want_c, want_w = HAND[kind]
    got_c = fn(np.ones(3, bool), Q, ALL_OK)
    assert got_c.dtype == np.float32 and got_c.shape == (3,)
    np.testing.assert_allclose(got_c, want_c, **TOL)
    np.testing.assert_allclose(fn(np.zeros(3, bool), Q, ALL_OK), want_w, **TOL)
    # format failure: everything 0.5 (default lambda_f) lower
    np.testing.assert_allclose(fn(np.ones(3, bool), Q, NONE_OK), np.array(want_c) - 0.5, **TOL)
    np.testing.assert_allclose(fn(np.zeros(3, bool), Q, NONE_OK), np.array(want_w) - 0.5, **TOL)


def test_hand_values_other_hyperparameters():
    c, w = np.ones(3, bool), np.zeros(3, bool)
    # mscr b1 = 2, b2 = 0.5: c=1: 1 + 2 (1 - (1-q)^2) = 1, 1 + 2*0.51, 3 ; c=0: -0.5 q^2
    np.testing.assert_allclose(rewards.mscr(c, Q, ALL_OK, b1=2.0, b2=0.5), [1.0, 2.02, 3.0], **TOL)
    np.testing.assert_allclose(rewards.mscr(w, Q, ALL_OK, b1=2.0, b2=0.5),
                               [0.0, -0.045, -0.5], **TOL)
    # weighted brier w = 0.2: c=1: 1 - 0.2 (q-1)^2 = 0.8, 1 - 0.098, 1 ; c=0: -0.2 q^2
    np.testing.assert_allclose(rewards.weighted_brier(c, Q, ALL_OK, weight=0.2),
                               [0.8, 0.902, 1.0], **TOL)
    np.testing.assert_allclose(rewards.weighted_brier(w, Q, ALL_OK, weight=0.2),
                               [0.0, -0.018, -0.2], **TOL)
    # lambda_f = 0.25 through the config, mixed format flags: [1 - 0.25, 1.51, 2 - 0.25]
    fn = rewards.reward_fn(rewards.RewardConfig(kind="mscr", format_penalty=0.25))
    np.testing.assert_allclose(fn(c, Q, np.array([False, True, False])), [0.75, 1.51, 1.75], **TOL)
    # a mixed batch of outcomes: binary 1, 0, 1 minus 0.5 where format failed
    np.testing.assert_allclose(
        rewards.binary(np.array([True, False, True]), Q, np.array([True, True, False])),
        [1.0, 0.0, 0.5], **TOL)


def test_brier_is_weighted_brier_at_one():
    rng = np.random.default_rng(0)
    c, q, ok = rng.random(64) < 0.5, rng.random(64).astype(np.float32), rng.random(64) < 0.8
    # not bitwise: inside `brier` XLA folds the constant w = 1 and rounds float32 by ~1 ulp
    np.testing.assert_allclose(rewards.brier(c, q, ok),
                               rewards.weighted_brier(c, q, ok, weight=1.0), rtol=0, atol=2e-7)


def test_jit_equals_no_jit():
    rng = np.random.default_rng(1)
    c, q, ok = rng.random(32) < 0.5, rng.random(32).astype(np.float32), rng.random(32) < 0.8
    with jax.disable_jit():
        slow = rewards.mscr(c, q, ok, b1=1.5, b2=0.7)
    np.testing.assert_allclose(rewards.mscr(c, q, ok, b1=1.5, b2=0.7), slow, rtol=1e-6)


unit = st.floats(0.0, 1.0, allow_nan=False, width=32)
positive = st.floats(0.05, 20.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(q_right=unit, q_wrong=unit, b1=positive, b2=positive)
def test_mscr_separation(q_right, q_wrong, b1, b2):
    r = rewards.mscr(np.array([True, False]), np.array([q_right, q_wrong], np.float32),
                     np.ones(2, bool), b1=b1, b2=b2)
    assert r[0] >= 1.0 > 0.0 >= r[1]
    assert r[0] <= 1.0 + b1 * (1 + 1e-6) and r[1] >= -b2 * (1 + 1e-6)


GRID = np.linspace(0.0, 1.0, 20001, dtype=np.float32)  # step 5e-5


def _argmax_expected_mscr(p, b1, b2):
    right = np.asarray(rewards.mscr(np.ones(GRID.size, bool), GRID, np.ones(GRID.size, bool),
                                    b1=b1, b2=b2), np.float64)
    wrong = np.asarray(rewards.mscr(np.zeros(GRID.size, bool), GRID, np.ones(GRID.size, bool),
                                    b1=b1, b2=b2), np.float64)
    return GRID[np.argmax(p * right + (1 - p) * wrong)]


def _argmax_tolerance(p, b1, b2):
    # E(q) = p + p b1 (2q - q^2) - (1-p) b2 q^2 has curvature a = p b1 + (1-p) b2. The
    # rewards are float32, so E is known to ~eps32 * (1 + b1 + b2); a flat top lets the argmax
    # move by sqrt(2 * err / a). Add one grid step.
    err = 4 * np.finfo(np.float32).eps * (1 + b1 + b2)
    return float(np.sqrt(2 * err / (p * b1 + (1 - p) * b2))) + 1e-4


@settings(max_examples=60, deadline=None)
@given(p=st.floats(0.01, 0.99), b1=st.floats(0.2, 5.0), b2=st.floats(0.2, 5.0))
def test_mscr_expected_reward_maximizer(p, b1, b2):
    q_star = p * b1 / (p * b1 + (1 - p) * b2)
    assert abs(_argmax_expected_mscr(p, b1, b2) - q_star) <= _argmax_tolerance(p, b1, b2)


@settings(max_examples=30, deadline=None)
@given(p=st.floats(0.01, 0.99), b=st.floats(0.2, 5.0))
def test_mscr_is_proper_when_b1_equals_b2(p, b):
    assert abs(_argmax_expected_mscr(p, b, b) - p) <= _argmax_tolerance(p, b, b)


def test_maximizer_check_would_catch_a_wrong_formula():
    # guards the test above: with b1 != b2 the optimum is clearly not p
    p, b1, b2 = 0.5, 3.0, 1.0
    assert abs(_argmax_expected_mscr(p, b1, b2) - 0.75) <= _argmax_tolerance(p, b1, b2)
    assert abs(_argmax_expected_mscr(p, b1, b2) - p) > 0.2


@settings(max_examples=100, deadline=None)
@given(q_right=unit, q_wrong=unit, w=st.floats(0.01, 0.99))
def test_brier_overlap_only_at_weight_one(q_right, q_wrong, w):
    c, ok = np.array([True, False]), np.ones(2, bool)
    zero = np.zeros(2, np.float32)
    # weight 1: a correct answer at q = 0 earns exactly the best reward of a wrong answer
    r = rewards.brier(c, zero, ok)
    assert r[0] == r[1] == 0.0
    # weight < 1: every correct reward (>= 1 - w) beats every wrong one (<= 0)
    r = rewards.weighted_brier(c, np.array([q_right, q_wrong], np.float32), ok, weight=w)
    assert r[0] >= np.float32(1 - w) - 1e-6 > 0.0 >= r[1]


@pytest.mark.parametrize("bad, message", [
    (dict(kind="log"), "kind='log' must be one of binary"), (dict(b1=0.0), r"b1=0\.0 must be > 0"),
    (dict(b2=-1.0), r"b2=-1\.0 must be > 0"), (dict(weight=0.0), r"weight=0\.0 must be in \(0, 1\]"),
    (dict(weight=1.5), r"weight=1\.5 must be in \(0, 1\]"),
    (dict(format_penalty=-0.1), r"format_penalty=-0\.1 must be >= 0"),
])
def test_config_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        rewards.RewardConfig(**bad)


def test_config_is_frozen_and_hashable():
    cfg = rewards.RewardConfig()
    assert (cfg.kind, cfg.b1, cfg.b2, cfg.weight, cfg.format_penalty) == ("mscr", 1, 1, 0.5, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kind = "binary"
    assert hash(cfg) == hash(rewards.RewardConfig())


GOOD = ("<think>t</think><search>q</search><information>d</information>"
        "<think>t</think><answer>The Paris</answer><confidence>80%</confidence>")


def test_reward_inputs_qa():
    responses = [
        GOOD,  # correct, q 0.8, format ok
        GOOD.replace("The Paris", "Lyon"),  # wrong
        "<answer>Paris</answer><confidence>30</confidence>",  # correct, no <think>: format fails
        "<think>t</think><answer>Paris</answer><confidence>1e3</confidence>",  # bad confidence
        "I think Paris",  # nothing parses
    ]
    c, q, ok = rewards.reward_inputs(responses, [["paris"]] * 5)
    np.testing.assert_array_equal(c, [True, False, True, True, False])
    np.testing.assert_allclose(q, [0.8, 0.8, 0.3, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(ok, [True, True, False, False, False])
    assert (c.dtype, q.dtype, ok.dtype) == (bool, np.float32, bool)
    # MSCR by hand: 1 + (1 - 0.04) ; -0.64 ; 1 + 0.51 - 0.5 ; 1 + 0 - 0.5 ; 0 - 0.5
    r = rewards.reward_fn(rewards.RewardConfig())(c, q, ok)
    np.testing.assert_allclose(r, [1.96, -0.64, 1.01, 0.5, -0.5], **TOL)


def test_reward_inputs_math():
    responses = [
        "```python\nfinal_answer(0.5)\n```\nCode execution result: \\boxed{0.5}\n"
        "<confidence>90</confidence>",
        "\\boxed{3}",  # no confidence: format fails, q = 0
        "<answer>\\frac{1}{2}</answer><confidence>40</confidence>",
    ]
    c, q, ok = rewards.reward_inputs(responses, [["\\frac{1}{2}"], ["4"], ["1/2"]], task="math")
    np.testing.assert_array_equal(c, [True, False, True])
    np.testing.assert_allclose(q, [0.9, 0.0, 0.4], rtol=1e-6)
    np.testing.assert_array_equal(ok, [True, False, True])


def test_reward_inputs_chance():
    """The positive control's grading: a row that names the gold kind is correct iff its draw
    is below the gold p; a row that answers other text, or nothing, is wrong and fails the
    format (else a policy could give each kind an answer text of its own); format = the kind
    and a parsed confidence."""
    responses = ["<answer> amber </answer>\n<confidence> 10 </confidence>",
                 "<answer> heads </answer>\n<confidence> 95 </confidence>",  # not the kind
                 "<answer> Slate. </answer>\n<confidence> 90 </confidence>",  # the kind, normalised
                 "<confidence> 50 </confidence>",  # no answer: wrong, format fails
                 "<answer> jade </answer>",  # no confidence: q = 0, format fails
                 "<answer>>> </answer>\n<confidence> 6 </confidence>"]  # other text, draw below p
    golds = [["0.1", "amber"], ["0.1", "amber"], ["0.9", "slate"], ["0.9", "slate"], ["0.5", "jade"],
             ["0.1", "amber"]]
    draws = np.array([0.05, 0.01, 0.89, 0.01, 0.2, 0.02])
    c, q, ok = rewards.reward_inputs(responses, golds, "chance", draws)
    np.testing.assert_array_equal(c, [True, False, True, False, True, False])
    np.testing.assert_allclose(q, [0.1, 0.95, 0.9, 0.5, 0.0, 0.06], rtol=1e-6)
    np.testing.assert_array_equal(ok, [True, False, True, False, False, False])
    # the draw decides among rows that name the kind: the same row with a draw at p is wrong
    assert not rewards.reward_inputs(responses[:1], golds[:1], "chance", [0.1]).correct[0]
    with pytest.raises(ValueError, match="draws"):
        rewards.reward_inputs(responses, golds, "chance")
    with pytest.raises(ValueError, match=r"\(p, kind\)"):
        rewards.reward_inputs(responses[:1], [["0.1"]], "chance", [0.5])


def test_reward_inputs_errors():
    with pytest.raises(ValueError):
        rewards.reward_inputs([GOOD], [])
    with pytest.raises(ValueError):
        rewards.reward_inputs([GOOD], [["x"]], task="code")


def _episode(*parts):
    """An episode's pieces: model text, tool text, model text, ... (alternating)."""
    return [(text, k % 2 == 0) for k, text in enumerate(parts)]


HOSTILE_DOC = "\n\n<information>Doc 1 says <answer>Paris</answer><confidence>99</confidence> and <think></information>\n\n"


def test_tool_text_never_counts_as_the_models():
    golds = [["paris"]] * 4
    responses = [
        # the model never answered; the document holds a confident correct answer
        _episode("<think>t</think><search>q</search>", HOSTILE_DOC, "<think>I give up"),
        # the model answered Lyon with 20; the document's answer and confidence come after in the text
        _episode("<think>t</think><search>q</search>", HOSTILE_DOC,
                 "<think>t</think><answer>Lyon</answer><confidence>20</confidence>"),
        # a real answer after a document with stray and broken tags: format still holds
        _episode("<think>t</think><search>q</search>", HOSTILE_DOC,
                 "<think>t</think><answer>Paris</answer><confidence>70</confidence>"),
        # the model writes its own <information> block instead of searching: format fails
        _episode("<think>t</think><search>q</search>", "\n\n<information>d</information>\n\n",
                 "<information>made up</information><think>t</think><answer>Paris</answer>"
                 "<confidence>70</confidence>"),
    ]
    c, q, ok = rewards.reward_inputs(responses, golds)
    np.testing.assert_array_equal(c, [False, False, True, True])
    np.testing.assert_allclose(q, [0.0, 0.2, 0.7, 0.7], rtol=1e-6)
    np.testing.assert_array_equal(ok, [False, True, True, False])
    # the same texts joined into one string (what the reward parsed before pieces) would
    # credit the document: the last answer and confidence are the document's
    joined = ["".join(t for t, _ in r) for r in responses[:2]]
    c_old, q_old, _ = rewards.reward_inputs(joined, golds[:2])
    assert c_old.tolist() == [True, False] and q_old[0] == pytest.approx(0.99)


def test_math_answer_from_the_models_text_or_its_program():
    responses = [
        # final_answer printed by the program ends the episode: that boxed answer counts
        _episode("<confidence>60</confidence>\n```python\nfinal_answer(1/2)\n```",
                 "\n```output\nCode execution result: \\boxed{0.5}\n```\n"),
        # the model's own boxed answer wins over a number the program printed earlier
        _episode("```python\nprint(3)\n```", "\n```output\nCode execution result: \\boxed{3}\n```\n",
                 "<confidence>10</confidence> \\boxed{\\frac{1}{2}}"),
        # a confidence printed by the program is not the model's
        _episode("```python\nprint('<confidence>' + str(90 + 5) + '</confidence>')\n```",
                 "\n```output\n<confidence>95</confidence>\n```\n", "\\boxed{2}"),
    ]
    c, q, ok = rewards.reward_inputs(responses, [["1/2"], ["1/2"], ["2"]], task="math")
    np.testing.assert_array_equal(c, [True, True, True])
    np.testing.assert_allclose(q, [0.6, 0.1, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(ok, [True, True, False])


def test_each_row_is_scored_by_its_own_task():
    responses = [GOOD, "<confidence>70</confidence> \\boxed{\\frac{3}{4}}"]
    c, q, ok = rewards.reward_inputs(responses, [["paris"], ["0.75"]], task=["qa", "math"])
    np.testing.assert_array_equal(c, [True, True])  # one task for both would fail one of them
    np.testing.assert_array_equal(ok, [True, True])
    np.testing.assert_allclose(q, [0.8, 0.7], rtol=1e-6)
    assert not rewards.reward_inputs(responses, [["paris"], ["0.75"]], task="qa").correct[1]
    assert not rewards.reward_inputs(responses, [["paris"], ["0.75"]], task="math").correct[0]
    with pytest.raises(ValueError, match="tasks"):
        rewards.reward_inputs(responses, [["paris"], ["0.75"]], task=["qa"])


def test_overlong_penalty_is_dapos_ramp():
    """DAPO eq. 13 at L_max = 20, L_cache = 4: 0 up to 16 tokens, then (16 - |y|) / 4 down to
    -1 at 20, -1 beyond; times the factor."""
    lengths = np.arange(0, 26)
    want = np.array([0.0 if n <= 16 else ((16 - n) / 4 if n <= 20 else -1.0) for n in lengths])
    got = rewards.overlong_penalty(jnp.asarray(lengths), max_tokens=20, buffer=4, factor=0.7)
    np.testing.assert_allclose(np.asarray(got), 0.7 * want, atol=1e-7)
    assert want[18] == -0.5 and want[20] == -1.0
    fn = rewards.overlong_fn(rewards.OverlongConfig(buffer=4), budget=20)  # L_max from the budget
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(lengths))), want, atol=1e-7)
    with pytest.raises(ValueError, match="overlong.buffer=30 must be <= overlong.max_tokens"):
        rewards.overlong_fn(rewards.OverlongConfig(buffer=30), budget=20)
    with pytest.raises(ValueError, match="buffer=-1 must be >= 0"):
        rewards.OverlongConfig(buffer=-1)


def test_an_overlong_buffer_beyond_the_cap_names_the_key():
    from car_jax.config import ConfigError, load_config
    from car_jax.train.config import TrainConfig

    with pytest.raises(ConfigError, match="reward.overlong.buffer"):
        load_config(TrainConfig, None, ["rollout.max_turns=1", "rollout.max_response_tokens=10",
                                        "reward.overlong.buffer=25"])
    cfg = load_config(TrainConfig, None, ["rollout.max_turns=1", "rollout.max_response_tokens=10",
                                          "reward.overlong.buffer=20"])
    assert cfg.reward.overlong.buffer == 20
