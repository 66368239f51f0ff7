"""DAPO's dynamic sampling (`car_jax.rl.dynamic`, `rl.dynamic_sampling`): which groups carry a
signal, re-derived row by row in plain Python; which groups a step keeps; and, through the
real trainer on a tiny random model, the rounds a step samples, the data it consumes, the
groups it trains on and the metrics it logs."""
import numpy as np
import pytest

from car_jax.calibration.rewards import RewardInputs
from car_jax.config import ConfigError, load_config
from car_jax.rl import dynamic
from car_jax.train.config import TrainConfig
from car_jax.train.log import Timer
from car_jax.train.trainer import Trainer
from tests.test_multihost import tiny_folder  # noqa: F401 (the fixture)


def signal_by_hand(rewards, correct, keep, g, kind):
    out = []
    for u in range(len(rewards) // g):
        rows = [i for i in range(u * g, (u + 1) * g) if keep[i]]
        values = [float(np.float32(rewards[i])) if kind == "reward" else bool(correct[i]) for i in rows]
        out.append(len(rows) >= 2 and len(set(values)) > 1)
    return np.array(out)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["reward", "accuracy"])
def test_group_signal_equals_a_row_by_row_rederivation(seed, kind):
    rng = np.random.default_rng(seed)
    g, u = int(rng.integers(2, 6)), 40
    correct = rng.random(u * g) < rng.choice([0.0, 0.5, 1.0], u * g)  # many all-right / all-wrong groups
    # rewards: correctness plus, in some groups, a confidence term of ~1e-3 (all-wrong groups differ)
    rewards = correct.astype(np.float32) + (rng.random(u * g) < 0.3) * rng.integers(0, 3, u * g) * 1e-3
    keep = rng.random(u * g) < 0.85
    got = dynamic.group_signal(rewards.astype(np.float32), correct, keep, g, kind)
    np.testing.assert_array_equal(got, signal_by_hand(rewards, correct, keep, g, kind))
    assert 0 < got.sum() < u  # the scripted batch has both kinds of group


def test_group_signal_cases():
    r = np.array([1, 1, 0, 0, 0.001, 0, 1, 0], np.float32)
    c = np.array([1, 1, 0, 0, 0, 0, 1, 0], bool)
    keep = np.ones(8, bool)
    assert dynamic.group_signal(r, c, keep, 2, "reward").tolist() == [False, False, True, True]
    assert dynamic.group_signal(r, c, keep, 2, "accuracy").tolist() == [False, False, False, True]
    assert dynamic.group_signal(r, c, keep, 2, "off").tolist() == [True] * 4
    # a group with one kept row has no spread, whatever its dropped row says
    assert dynamic.group_signal(r, c, np.array([1, 1, 1, 1, 1, 1, 1, 0], bool), 2, "reward").tolist() == [
        False, False, True, False]
    with pytest.raises(ValueError, match="7 rows are not whole groups of 2"):
        dynamic.group_signal(r[:7], c[:7], keep[:7], 2, "reward")


def test_select_takes_signal_groups_in_round_order_then_fills():
    rounds = [np.array([False, True, False]), np.array([True, False, True])]
    picked = dynamic.select(rounds, 3)
    assert picked.picked == ((0, 1), (1, 0), (1, 2)) and picked.filled == 0
    picked = dynamic.select(rounds, 2)
    assert picked.picked == ((0, 1), (1, 0))
    none = [np.zeros(3, bool), np.array([False, True, False])]
    picked = dynamic.select(none, 3)
    assert picked.picked == ((1, 1), (0, 0), (0, 1)) and picked.filled == 2
    assert dynamic.short(none, 2) and not dynamic.short(rounds, 3)
    with pytest.raises(ValueError, match="6 groups sampled, 7 needed"):
        dynamic.select(rounds, 7)


@pytest.mark.parametrize("bad, message", [
    ("rl.dynamic_sampling.filter=always", "rl.dynamic_sampling.filter"),
    ("rl.dynamic_sampling.max_rounds=0", "rl.dynamic_sampling.max_rounds: 0 must be >= 1"),
])
def test_bad_settings_name_the_key(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, [bad])


def train_args(folder, run_dir, *extra) -> list[str]:
    """Tiny random model, world data (4 prompts x G = 2 a round), greedy, one process."""
    return [f"model.path={folder}", f"run.dir={run_dir}", "rl.steps=1", "rl.prompts_per_step=4",
            "rollout.group_size=2", "rollout.max_turns=0", "rollout.max_response_tokens=4", "rollout.temperature=0",
            "data.limit=40", "sft.steps=0", "run.loggers=[]", "run.export_hf=false", "mesh.devices=1", *extra]


def test_a_step_samples_rounds_until_its_groups_carry_a_signal(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    """The random model never answers in format, so every reward is the format penalty: we
    script the reward inputs of each round instead (round r's group u correct as SCRIPT
    says) and check which episodes reach the batch, the data consumed and the metrics."""
    script = {0: [[0, 0], [1, 0], [1, 1], [0, 0]],  # one group with a signal (group 1)
              1: [[1, 1], [0, 1], [0, 0], [1, 1]],  # one more (group 1)
              2: [[1, 0], [0, 1], [1, 0], [0, 0]]}  # three more: two fill the batch
    sample = Trainer._sample

    def scripted(self, step, round_, policy, stats, timer):
        examples, trajs, inputs = sample(self, step, round_, policy, stats, timer)
        correct = np.array(script[round_], bool).reshape(-1)
        return examples, trajs, RewardInputs(correct, np.full(8, 0.5, np.float32), np.ones(8, bool))

    monkeypatch.setattr(Trainer, "_sample", scripted)
    cfg = load_config(TrainConfig, None, train_args(tiny_folder, tmp_path / "on", "rl.dynamic_sampling.filter=accuracy",
                                                    "rl.dynamic_sampling.max_rounds=5"))
    trainer = Trainer(cfg)
    stream = [ex.question for ex in trainer.next_examples(12)]
    trainer.data_pos = 0
    trajs, host, _, _, examples, extra = trainer.rollout(1, Timer())
    assert trainer.data_pos == 12  # three rounds of 4 prompts, then it stopped
    # round 0 group 1, round 1 group 1, round 2 groups 0 and 1: prompts 1, 5, 8, 9 of the stream
    assert [ex.question for ex in examples] == [stream[i] for i in (1, 5, 8, 9)]
    assert host.correct.reshape(4, 2).tolist() == [[True, False], [False, True], [True, False], [False, True]]
    assert host.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(trajs) == 8 and all(t.prompt_ids.tolist() == trajs[2 * (i // 2)].prompt_ids.tolist()
                                   for i, t in enumerate(trajs))
    assert extra == {"dynamic/rounds": 3.0, "dynamic/prompts": 12.0, "dynamic/groups_dropped": 7.0,
                     "dynamic/signal_share": 5 / 12, "dynamic/filled": 0.0}
    trainer.setup.toolbox.close()


def test_bounded_rounds_fill_the_batch_and_off_changes_nothing(tiny_folder, tmp_path):  # noqa: F811
    """Unscripted: every group of the random model has equal rewards (all format penalties),
    so a step uses all its rounds and fills its batch with dropped groups; with the filter
    off a step samples one round, as before."""
    on = Trainer(load_config(TrainConfig, None, train_args(tiny_folder, tmp_path / "on",
                                                           "rl.dynamic_sampling.filter=reward",
                                                           "rl.dynamic_sampling.max_rounds=2")))
    row = on.run()[0]
    assert on.data_pos == 8
    assert {k: row[k] for k in row if k.startswith("dynamic/")} == {
        "dynamic/rounds": 2.0, "dynamic/prompts": 8.0, "dynamic/groups_dropped": 8.0, "dynamic/signal_share": 0.0,
        "dynamic/filled": 4.0}
    assert row["groups/equal_reward_share"] == 1.0
    off = Trainer(load_config(TrainConfig, None, train_args(tiny_folder, tmp_path / "off")))
    row_off = off.run()[0]
    assert off.data_pos == 4 and not any(k.startswith("dynamic/") for k in row_off)
    # the filled batch is round 0's groups, in order: the same rows as the run without the filter
    for key in ("reward", "accuracy", "confidence", "response_tokens", "loss"):
        assert row[key] == pytest.approx(row_off[key], rel=1e-6, abs=1e-9), key


def test_two_processes_agree_on_the_rounds_and_train_like_one(tiny_folder, tmp_path):  # noqa: F811
    """`car-jax train` with dynamic sampling as 2 processes x 4 devices and as 1 process x 8:
    the random model's groups never carry a signal, so every step runs all its rounds (the
    processes must agree on each round: the decode is a collective) and fills its batch with
    round 0's groups, each process its own block: the same rows as one process, so the same
    metrics, and every dynamic/* metric counts every process's groups."""
    from car_jax.cli import main
    from car_jax.train.log import read_metrics
    from tests.multihost import launch, succeeded
    from tests.test_multihost import COMPARED, train_args as multihost_args

    extra = ["rl.steps=2", "rl.dynamic_sampling.filter=reward", "rl.dynamic_sampling.max_rounds=2"]
    one, two = tmp_path / "1x8", tmp_path / "2x4"
    assert main([*multihost_args(tiny_folder, one), *extra]) == 0
    succeeded(launch([*multihost_args(tiny_folder, two), *extra], processes=2, devices=4))
    a, b = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in ra if k.startswith("dynamic/")} == {
            "dynamic/rounds": 2.0, "dynamic/prompts": 4.0, "dynamic/groups_dropped": 4.0,
            "dynamic/signal_share": 0.0, "dynamic/filled": 2.0}
        assert {k: rb[k] for k in rb if k.startswith("dynamic/")} == {k: ra[k] for k in ra if k.startswith("dynamic/")}
        for key in COMPARED:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
