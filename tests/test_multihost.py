"""`car-jax train` as 2 processes x 4 CPU devices (jax.distributed on loopback, gloo), both
processes killed after step 1 and restarted, equals the same run straight as 1 process x 8
devices (this test's own process): the per-step metrics, metrics.jsonl written once per step
by process 0, the exported final params. The restarted processes run steps 2 and 3, so the
run carries a step's state in memory from one step to the next over 2 processes too."""
import json
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from car_jax.assets import smollm2_gguf
from car_jax.config import load_config
from car_jax.loading import load_tokenizer
from car_jax.sharding import flatten_params, params_shardings
from car_jax.train.config import TrainConfig
from car_jax.train.log import read_metrics
from car_jax.train.trainer import Trainer
from tests.hf_factory import build
from tests.multihost import launch, succeeded

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_policy")
    build("llama", folder, vocab_size=49152, hidden_size=32, initializer_range=0.5)  # logits far from uniform
    load_tokenizer(smollm2_gguf()).save_pretrained(str(folder))
    return folder


def train_args(folder, run_dir) -> list[str]:
    """Tiny random model, world data, the search tool, KL on, SFT off, 3 steps with a
    checkpoint each; 2 prompts x G=4 = 8 rows, one micro-batch split over fsdp=8. The 6
    prompts of the 3 steps are 6 different questions (of data.limit=10) whose prompts pad to
    the same width: each process compiles every rollout program once. The random
    model's rewards are all equal (no format): the entropy bonus moves the policy, so
    that steps 2 and 3 have a KL and a loss to compare. Greedy rollouts, and Adam with a large eps
    (an update proportional to the gradient rather than its sign): rounding-level gradient
    differences between the runs stay rounding-level instead of flipping sampled tokens
    or whole +-lr updates."""
    return ["train", f"model.path={folder}", f"run.dir={run_dir}", "rl.steps=3", "rl.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_turns=1", "rollout.max_response_tokens=6",
            "rollout.max_obs_tokens=16", "rollout.temperature=0", "rl.optim.lr=0.01", "rl.optim.eps=0.01", "rl.mini_batch=8", "rl.micro_batch=8",
            "rl.loss.kl_coef=0.01", "rl.loss.entropy_coef=0.01", "data.limit=10", "sft.steps=0", "run.checkpoint_every=1",
            "run.tensorboard=false", "run.export_hf=true", "mesh.devices=8", "mesh.fsdp=8", "mesh.tp=1"]


COMPARED = ("reward", "loss", "kl", "entropy", "accuracy", "confidence", "format_ok", "response_tokens",
            "tool_calls", "grad_norm")


def assert_same_run(a_dir, b_dir, start):
    """Each step once in both metrics files, the same metrics (1e-5 relative), and the same
    update of every exported tensor. The same programs run on the same 8-device mesh in both;
    only the collectives cross a process boundary (gloo), and their float32 sums round in
    another order: the gradient of a step is a sum of per-row terms that largely cancel, so
    the update of a tensor differs by ~1e-4 of its size (measured 6.6e-5), not by 1e-7."""
    a, b = read_metrics(a_dir), read_metrics(b_dir)
    assert [r["step"] for r in a] == [1, 2, 3] and [r["step"] for r in b] == [1, 2, 3]  # each step once
    for ra, rb in zip(a, b):
        for key in COMPARED:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    pa, pb = load_file(a_dir / "hf" / "model.safetensors"), load_file(b_dir / "hf" / "model.safetensors")
    assert sorted(pa) == sorted(pb)
    for name, initial in load_file(start / "model.safetensors").items():
        moved = np.linalg.norm(pa[name] - initial)
        assert moved > 0, name
        assert np.linalg.norm(pb[name] - pa[name]) <= 1e-3 * moved, name


def test_two_processes_killed_and_restarted_train_like_one(tiny_folder, tmp_path):
    from car_jax.cli import main

    one, two = tmp_path / "1x8", tmp_path / "2x4"
    assert main(train_args(tiny_folder, one)) == 0  # 1 process x the 8 devices of this one
    rows = read_metrics(one)
    assert rows[-1]["kl"] > 0 and any(r["grad_norm"] > 0 for r in rows)  # the compared values move

    crashed = launch(train_args(tiny_folder, two), processes=2, devices=4, kill_at=2)
    # each process SIGKILLs itself; one that is slower to get there may be aborted first by
    # JAX's runtime, which stops a process whose peer died (SIGABRT): killed either way
    assert all(code in (-signal.SIGKILL, -signal.SIGABRT) for code, _, _ in crashed), [c for c, _, _ in crashed]
    assert [r["step"] for r in read_metrics(two)] == [1] and not (two / "hf").exists()
    succeeded(launch(train_args(tiny_folder, two), processes=2, devices=4))
    assert_same_run(one, two, tiny_folder)
    # one writer: process 1 wrote no file of its own (one config, one metrics file)
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    summary = json.loads((two / "last_step.json").read_text())
    assert summary["step"] == 3


def test_the_sft_result_keeps_the_sharding_table_layout(tiny_folder, tmp_path):
    """The SFT warm start's params come back in the table's shardings (the jitted SFT step
    lays its outputs out as the compiler likes): on a mesh over several processes the train
    step refuses any other layout of its inputs."""
    args = [a for a in train_args(tiny_folder, tmp_path)[1:] if not a.startswith("sft.")]
    trainer = Trainer(load_config(TrainConfig, None, [*args, "sft.steps=1", "sft.batch=8", "sft.data=world"]))
    params = flatten_params(trainer.setup.state.params)
    want = flatten_params(params_shardings(trainer.setup.state.params, trainer.setup.model.mesh))
    assert [p for p, x in params.items() if not x.sharding.is_equivalent_to(want[p], x.ndim)] == []
    trainer.setup.toolbox.close()
    trainer.warm_ckpt.close()
