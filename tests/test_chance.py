"""The positive control's task (car_jax.data.chance): its examples, grading draws and SFT
demonstrations, and the tiny random model it trains."""
import json

import numpy as np

from car_jax.calibration import parsing
from car_jax.data import chance, load_dataset, make_prompt
from car_jax.train.sft import chance_demos


def test_examples_cover_every_kind_in_any_prefix():
    exs = load_dataset("chance")
    assert len(exs) == len(chance.KINDS) * chance.PER_KIND
    assert len({e.id for e in exs}) == len(exs)
    assert [e.meta["kind"] for e in load_dataset("chance", "extremes")[:2]] == ["amber", "slate"]
    assert {e.meta["p"] for e in load_dataset("chance", "extremes")} == {0.1, 0.9}
    first = exs[:len(chance.KINDS)]  # data.limit=5 keeps one of each kind
    assert [e.meta["kind"] for e in first] == [k for k, _ in chance.KINDS]
    for e in exs:
        p = dict(chance.KINDS)[e.meta["kind"]]
        assert e.task == "chance" and float(e.golden_answers[0]) == p == e.meta["p"]
        assert e.golden_answers[1] == e.meta["kind"]
        assert e.data_source == f"chance-{e.meta['kind']}" and e.meta["kind"] in e.question
    messages = make_prompt(exs[0], "chance")
    assert "0 to 100" in messages[0]["content"] and messages[1]["content"] == exs[0].question


def test_draws_depend_on_seed_and_step_only():
    a = chance.draws(3, 7, 40)
    np.testing.assert_array_equal(a, chance.draws(3, 7, 40))
    np.testing.assert_array_equal(a[:10], chance.draws(3, 7, 10))  # a process's slice is the same
    assert not np.array_equal(a, chance.draws(3, 8, 40)) and not np.array_equal(a, chance.draws(4, 7, 40))
    big = chance.draws(0, 1, 100_000)
    assert 0.0 <= big.min() and big.max() < 1.0 and abs(big.mean() - 0.5) < 0.01


def test_demonstrations_state_uniform_random_confidences():
    """The warm start's demonstrations name the kind and state seeded uniform draws
    (re-derived with numpy), the same for every kind in distribution: no information."""
    exs = chance.examples()
    demos = chance_demos(exs, "random", seed=5)
    want = np.random.default_rng(5).integers(0, 101, size=len(exs))
    for ex, demo, c in zip(exs, demos, want):
        [seg] = demo["segments"]
        parsed = parsing.parse_response(seg["text"])
        assert seg["train"] and parsed.answer == ex.meta["kind"]
        assert parsed.q == np.float32(c / 100)
        assert demo["messages"] == make_prompt(ex, "chance")
    json.dumps(demos)  # what write_demos stores
    fixed = {s["segments"][0]["text"].split("<confidence>")[1] for s in chance_demos(exs[:3], 42)}
    assert fixed == {" 42 </confidence>"}
