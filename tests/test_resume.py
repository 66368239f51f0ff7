"""Resume: 1 step, stop, resume, 1 more step gives the same metrics as 2 steps straight,
with an SFT warm start and the KL term on (the reference is the SFT result in both)."""
import shutil

import pytest

from car_jax.config import load_config
from car_jax.train.config import TrainConfig
from car_jax.train.log import read_metrics
from car_jax.train.trainer import train
from tests.hf_factory import build_agent


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_agent(tmp_path_factory.mktemp("tiny_policy"), hidden_size=32)


def config(folder, run_dir, steps):
    return load_config(TrainConfig, None, [
        f"model.path={folder}", f"run.dir={run_dir}", f"rl.steps={steps}", "rl.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_response_tokens=6",
        "rollout.max_obs_tokens=16", "rl.optim.lr=1e-3", "rl.mini_batch=2", "rl.micro_batch=1", "rl.epochs=2",
        "data.limit=4", "sft.data=world", "sft.steps=1", "sft.batch=2", "sft.lr=1e-2",
        "rl.loss.kl_coef=0.01", "run.checkpoint_every=1", "run.tensorboard=false", "run.export_hf=false",
        "mesh.devices=1"])  # the sharded step is checked in test_train_step


def test_resume_equals_straight_run(tiny_folder, tmp_path):
    straight = train(config(tiny_folder, tmp_path / "a", 2))
    # the stopped run starts from the straight run's saved warm start (dir/warm_start, what a
    # run stopped right after its SFT reads back) instead of training the same SFT step again:
    # both runs then read the reference from the saved file, the straight one holds it in memory
    shutil.copytree(tmp_path / "a" / "warm_start", tmp_path / "b" / "warm_start")
    first = train(config(tiny_folder, tmp_path / "b", 1))
    assert [r["step"] for r in first] == [1]
    resumed = train(config(tiny_folder, tmp_path / "b", 2))
    assert [r["step"] for r in resumed] == [2]  # picked up after step 1
    # every metric but the wall-clock ones (times, and the rates divided by them) and the
    # engine's scheduling ones (rollout/: they depend on when tool results come back)
    keys = [k for k in straight[0] if not k.startswith(("time/", "perf/", "rollout/")) and k != "tokens_per_s"]
    for a, b in zip(straight, first + resumed, strict=True):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7, nan_ok=True), (a["step"], k)
    # the metrics file of the resumed run holds each step once
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2]
    # training moved the policy: some loss signal was there
    assert any(abs(r["grad_norm"]) > 0 for r in straight)
    # the policy left the reference: the KL compared above is not trivially 0 on both sides
    assert straight[-1]["kl"] > 0
    shutil.rmtree(tmp_path)
