"""configs/: every YAML loads into TrainConfig (a stale key fails here), the paper configs hold
Search-R1's recipe, the batch sizes divide as the training loop demands, tiny_test.yaml trains
end to end, and the same run stopped after step 1 and resumed gives the same metrics as the
straight run. The tpu_scripts are tested in test_tpu_scripts.py."""
import dataclasses
import shutil
from pathlib import Path

import pytest

from car_jax.config import load_config
from car_jax.train.config import TrainConfig
from car_jax.train.log import read_metrics
from car_jax.train.trainer import train
from tests.hf_factory import build_agent

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXPERIMENTS = ROOT / "configs" / "experiment"  # every file there loads and plans: tests/test_experiment.py
PAPER = ["qwen2.5-3b_car_mscr", "qwen2.5-7b_car_mscr", "qwen3-4b_car_mscr", "qwen2.5-3b_brier",
         "qwen2.5-3b_binary", "qwen2.5-32b_car_mscr_v5p128"]


def load(name: str) -> TrainConfig:
    return load_config(TrainConfig, ROOT / "configs" / f"{name}.yaml")


def test_the_named_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"smollm2_world_cpu", "tiny_test", *PAPER} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_batches_divide(path):
    cfg = load_config(TrainConfig, path)
    rl = cfg.rl
    # what Trainer.update checks at run time, checked here before anyone books a TPU
    n = rl.prompts_per_step * cfg.rollout.group_size
    mini = rl.mini_batch or n
    micro = rl.micro_batch or mini
    assert n % mini == 0 and mini % micro == 0, (n, mini, micro)
    if cfg.mesh.fsdp > 0:
        assert micro % cfg.mesh.fsdp == 0
    assert rl.optim.total_steps == rl.steps  # the lr schedule spans the run
    assert 0 <= rl.optim.warmup_steps < rl.steps
    assert cfg.rollout.group_size >= 2  # GRPO needs a group to compare within


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_follow_search_r1(name):
    cfg = load(name)
    assert_search_r1_recipe(cfg)
    assert cfg.run.dir.endswith(name)


def assert_search_r1_recipe(cfg: TrainConfig):
    """SPEC.md section 6's Search-R1 training settings, with car_jax's search template."""
    r, rl = cfg.rollout, cfg.rl
    assert (r.group_size, r.max_turns, r.max_response_tokens, r.max_obs_tokens) == (5, 4, 500, 500)
    assert (r.temperature, r.top_p, r.protocol) == (1.0, 0.95, "car_search")
    assert rl.optim.lr == 1e-6 and rl.optim.grad_clip == 1.0 and rl.epochs == 1
    assert rl.prompts_per_step == 512 and rl.mini_batch == 256 * r.group_size
    assert rl.optim.warmup_steps == round(0.285 * rl.steps)  # Search-R1's warmup ratio
    assert (rl.loss.kl_type, rl.loss.kl_coef) == ("low_var_kl", 0.001)
    assert (rl.loss.clip_low, rl.loss.clip_high) == (0.2, 0.2)
    assert (cfg.tools.retriever, cfg.tools.topk) == ("http://127.0.0.1:8000/retrieve", 3)
    assert (cfg.model.dtype, cfg.model.param_dtype, cfg.model.remat) == ("bfloat16", "float32", True)
    assert cfg.data.template == "search"


@pytest.mark.parametrize("name", ["qwen2.5-3b_car_mscr", "qwen2.5-7b_car_mscr", "qwen3-4b_car_mscr",
                                  "qwen2.5-32b_car_mscr_v5p128"])
def test_car_configs_use_mscr(name):
    reward = load(name).reward
    assert (reward.kind, reward.b1, reward.b2, reward.format_penalty) == ("mscr", 1.0, 1.0, 0.5)


@pytest.mark.parametrize("name,kind", [("qwen2.5-3b_brier", "brier"), ("qwen2.5-3b_binary", "binary")])
def test_ablations_differ_from_car_only_in_the_reward(name, kind):
    base, variant = load("qwen2.5-3b_car_mscr"), load(name)
    assert variant.reward.kind == kind
    assert variant == dataclasses.replace(base, reward=variant.reward,
                                          run=dataclasses.replace(base.run, dir=variant.run.dir))


def test_sharded_config_fits_qwen2_5_32b():
    cfg = load("qwen2.5-32b_car_mscr_v5p128")
    fsdp, tp = cfg.mesh.fsdp, cfg.mesh.tp
    assert fsdp * tp == 64  # the chips of a v5p-128 slice
    assert cfg.model.remat
    # Qwen2.5-32B's config.json: the sharding table splits heads, kv heads, mlp and vocab
    # over tp and the model width over fsdp; each must divide
    heads, kv_heads, mlp, vocab, width = 40, 8, 27648, 152064, 5120
    assert all(d % tp == 0 for d in (heads, kv_heads, mlp, vocab)) and width % fsdp == 0


def test_cpu_config_is_small():
    cfg = load("smollm2_world_cpu")
    assert cfg.model.path == "" and cfg.mesh.devices == 1  # embedded model, one CPU device
    assert (cfg.data.train, cfg.tools.retriever) == ("world", "world")
    assert cfg.rl.prompts_per_step * cfg.rollout.group_size <= 16
    assert cfg.sft.data == "world" and cfg.sft.steps > 0  # the 135M model needs the format first


def trajectories_per_run(cfg) -> int:
    """GRPO trajectories one run of an experiment samples: prompts a step x G x steps."""
    return cfg.train.rl.prompts_per_step * cfg.train.rollout.group_size * cfg.train.rl.steps


def test_gpu_experiment_is_the_paired_design_at_over_50x_the_budget():
    """world_car_gpu.yaml: world_car_paired.yaml's design (arms, seeds, per-seed order, warm
    start, episode, reward, lr, evaluation) with only the budget, the eval sets and the device
    settings changed; its train section fits one H100 by the planner."""
    from car_jax.data import world_large
    from car_jax.experiment import plan
    from car_jax.experiment.config import load_experiment
    from car_jax.plan import make_plan

    cpu, gpu = (load_experiment(EXPERIMENTS / f) for f in ("world_car_paired.yaml", "world_car_gpu.yaml"))
    assert trajectories_per_run(gpu) >= 50 * trajectories_per_run(cpu)
    assert gpu.arms == cpu.arms and gpu.seeds == cpu.seeds and gpu.baseline == cpu.baseline
    assert gpu.data_order == cpu.data_order == "per_seed"
    assert {u.config.data.shuffle_seed for u in plan(gpu) if u.kind == "train"} == set(gpu.seeds)
    assert gpu.warm_start == cpu.warm_start and gpu.warm_start.confidence == "random"
    assert gpu.equivalence == cpu.equivalence and gpu.dir != cpu.dir
    # the evaluation: the same splits and greedy episode, every question of each split
    assert gpu.eval.episode == cpu.eval.episode and gpu.eval.n_boot == cpu.eval.n_boot
    assert {k: (d.path, d.split) for k, d in gpu.eval.splits.items()} == {
        k: (d.path, d.split) for k, d in cpu.eval.splits.items()}
    assert all(d.limit is None for d in gpu.eval.splits.values())
    assert all(d.limit is not None for d in cpu.eval.splits.values())
    # the train section: the CPU one but for the budget and the device fields
    g, c = gpu.train, cpu.train
    assert g == dataclasses.replace(
        c, model=dataclasses.replace(c.model, dtype=g.model.dtype, param_dtype=g.model.param_dtype,
                                     remat=g.model.remat),
        rollout=dataclasses.replace(c.rollout, group_size=g.rollout.group_size,
                                    max_concurrent=g.rollout.max_concurrent),
        rl=dataclasses.replace(c.rl, steps=g.rl.steps, prompts_per_step=g.rl.prompts_per_step,
                               mini_batch=g.rl.mini_batch, micro_batch=g.rl.micro_batch,
                               optim=dataclasses.replace(c.rl.optim, total_steps=g.rl.optim.total_steps)),
        run=dataclasses.replace(c.run, checkpoint_every=g.run.checkpoint_every))
    assert (g.model.dtype, g.model.param_dtype, g.mesh.devices) == ("bfloat16", "float32", 1)
    n = g.rl.prompts_per_step * g.rollout.group_size
    assert g.rl.optim.total_steps == g.rl.steps and g.rl.mini_batch in (0, n)  # one update a step, as on CPU
    assert g.rollout.max_concurrent == n  # every episode of a step in flight
    assert g.rl.steps * g.rl.prompts_per_step <= sum(world_large.SPLITS["train"])  # one pass, no repeats
    assert make_plan(g, 1, 1, "h100").fits  # the planner's default prompt (512 tokens) on one H100


def test_qwen_experiment_is_the_paper_recipe_on_search_r1_data():
    """nq_hotpotqa_qwen2.5-3b.yaml: its train section is configs/qwen2.5-3b_car_mscr.yaml's
    (SPEC.md section 6's numbers), its arms the paper's three, its evaluation NQ, HotpotQA
    and SimpleQA-verified only, its batches divisible over a v5p-8 (4) and an 8-GPU node."""
    from car_jax.experiment.config import DEFAULT_ARMS, load_experiment

    exp = load_experiment(EXPERIMENTS / "nq_hotpotqa_qwen2.5-3b.yaml")
    t = exp.train
    assert_search_r1_recipe(t)
    assert t.rl.steps == 1005 and t.rl.optim.total_steps == 1005 and t.rl.optim.warmup_steps == 286
    assert t.rl.mini_batch == 1280 and t.rollout.max_concurrent == 512
    base = load("qwen2.5-3b_car_mscr")
    assert t == dataclasses.replace(base, run=dataclasses.replace(base.run, dir=t.run.dir))
    assert (t.mesh.fsdp, t.mesh.tp, t.mesh.devices) == (-1, 1, 0)  # every device
    for fsdp in (4, 8):  # a v5p-8 slice's chips, an 8 x H100 node's GPUs
        assert t.rl.micro_batch % fsdp == 0 and exp.warm_start.batch % fsdp == 0
    assert exp.arms == DEFAULT_ARMS and exp.baseline == "vanilla"
    assert exp.warm_start.confidence == "random" and exp.equivalence.steps == 0
    # no offline-world split slips in (a partial eval section merges onto the default {id: world})
    assert set(exp.eval.splits) == {"id", "hotpotqa", "ood"}
    assert not any(d.path.startswith("world") for d in exp.eval.splits.values())
    assert exp.eval.splits["ood"].path.endswith(".csv")
    e = exp.eval.episode
    assert e.sampler.greedy and (e.max_turns, e.max_response_tokens, e.max_obs_tokens) == (4, 500, 500)


def test_qwen_experiment_splits_search_r1_test_file_as_its_comment_says(tmp_path, monkeypatch):
    """The command in nq_hotpotqa_qwen2.5-3b.yaml's comments writes its in-domain eval files
    from Search-R1's test.parquet (seven sources): NQ rows to eval.splits.id, HotpotQA rows to
    eval.splits.hotpotqa, and car_jax reads them."""
    import subprocess
    import sys

    from car_jax.data import load_dataset
    from car_jax.experiment.config import load_experiment
    from tests.test_data import _write_search_r1_parquet

    path = EXPERIMENTS / "nq_hotpotqa_qwen2.5-3b.yaml"
    line = next(x for x in path.read_text().splitlines() if "pq.write_table" in x)
    code = line.split('python -c "', 1)[1].rsplit('"', 1)[0]
    exp = load_experiment(path)
    monkeypatch.chdir(tmp_path)
    folder = Path(exp.train.data.train)
    folder.mkdir(parents=True)
    _write_search_r1_parquet(folder / "test.parquet")  # two nq rows, one hotpotqa row
    subprocess.run([sys.executable, "-c", code], check=True)
    nq, hotpot = (load_dataset(exp.eval.splits[k].path) for k in ("id", "hotpotqa"))
    assert [e.data_source for e in nq] == ["nq", "nq"] and [e.data_source for e in hotpot] == ["hotpotqa"]


def test_eval_configs_load():
    """configs/eval/*.yaml load into EvalConfig; the example spells out today's defaults."""
    from car_jax.eval.config import EvalConfig

    paths = sorted((ROOT / "configs" / "eval").glob("*.yaml"))
    assert paths
    for path in paths:
        load_config(EvalConfig, path)
    example = load_config(EvalConfig, ROOT / "configs" / "eval" / "world_search.yaml")
    assert dataclasses.replace(example, data=EvalConfig().data, output=EvalConfig().output) == EvalConfig()
    assert example.episode.sampler.greedy and example.tools.code_timeout_s == 10.0


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_agent(tmp_path_factory.mktemp("tiny_policy"), hidden_size=32)


def tiny_config(folder, run_dir, *overrides):
    """tiny_test.yaml on the tiny policy (one device: the sharded step is checked in
    test_train_step and test_multihost), with an entropy bonus: the random policy's rewards
    are all equal (no format), so without one the GRPO steps barely move it (a KL of ~3e-8 at
    step 2, below the resume comparison's abs 1e-7); with it the loss, the gradient and the KL
    to the SFT reference are well away from 0."""
    return load_config(TrainConfig, ROOT / "configs" / "tiny_test.yaml",
                       [f"model.path={folder}", f"run.dir={run_dir}", "rl.loss.entropy_coef=0.01", *overrides])


def test_tiny_config_trains_and_resumes_like_a_straight_run(tiny_folder, tmp_path):
    """tiny_test.yaml through every stage of a run (the SFT warm start, GRPO steps with the
    search tool and the KL term, checkpoints, metrics, the HF export); then the same run
    stopped after step 1 and resumed equals it, step by step (the KL reference is the SFT
    result in both)."""
    straight_dir, stopped_dir = tmp_path / "a", tmp_path / "b"
    cfg = tiny_config(tiny_folder, straight_dir)
    assert cfg.sft.steps and cfg.rl.loss.kl_coef and cfg.rl.steps >= 2 and cfg.mesh.devices == 1
    steps = list(range(1, cfg.rl.steps + 1))
    straight = train(cfg)
    assert [r["step"] for r in straight] == steps and [r["step"] for r in read_metrics(straight_dir)] == steps
    assert (straight_dir / "hf" / "config.json").is_file() and (straight_dir / "sft").is_dir()

    # the stopped run starts from the straight run's saved warm start (dir/warm_start, what a
    # run stopped right after its SFT reads back) instead of training the same SFT step again:
    # both runs then read the reference from the saved file, the straight one holds it in memory
    shutil.copytree(straight_dir / "warm_start", stopped_dir / "warm_start")
    first = train(tiny_config(tiny_folder, stopped_dir, "rl.steps=1"))  # the lr schedule is rl.optim's
    assert [r["step"] for r in first] == [1]
    resumed = train(tiny_config(tiny_folder, stopped_dir))
    assert [r["step"] for r in resumed] == steps[1:]  # picked up after step 1
    # every metric but the wall-clock ones (times, and the rates divided by them) and the
    # engine's scheduling ones (rollout/: they depend on when tool results come back)
    keys = [k for k in straight[0] if not k.startswith(("time/", "perf/", "rollout/")) and k != "tokens_per_s"]
    for a, b in zip(straight, first + resumed, strict=True):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7, nan_ok=True), (a["step"], k)
    # the metrics file of the resumed run holds each step once
    assert [r["step"] for r in read_metrics(stopped_dir)] == steps
    # training moved the policy: some loss signal was there
    assert any(abs(r["grad_norm"]) > 0 for r in straight)
    # the policy left the reference: the KL compared above is well above the comparison's abs 1e-7
    assert straight[-1]["kl"] > 1e-5
    shutil.rmtree(tmp_path)
