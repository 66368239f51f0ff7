"""Range checks of TrainConfig and EvalConfig: a value out of range fails at load time, as one
line naming the dotted key, the value and what is expected; values at the edge of a range load."""
import pytest

from car_jax.config import ConfigError, load_config
from car_jax.eval.config import EvalConfig
from car_jax.sharding import MeshConfig
from car_jax.train.config import TrainConfig

# (overrides, the message's start: "dotted.key: value", a piece of what is expected)
TRAIN_BAD = [
    ("seed=-1", "seed: -1", ">= 0"),
    ("model.dtype=fp33", "model.dtype: 'fp33'", "bfloat16"),
    ("model.param_dtype=int8", "model.param_dtype: 'int8'", "float32"),
    ("mesh.fsdp=0", "mesh.fsdp: 0", "-1 for the devices"),
    ("mesh.tp=-2", "mesh.tp: -2", ">= 1"),
    (["mesh.fsdp=-1", "mesh.tp=-1"], "mesh.tp: -1", "one axis at most"),
    ("mesh.devices=-1", "mesh.devices: -1", ">= 0"),
    ("data.train=''", "data.train: ''", "dataset"),
    ("data.template=chat", "data.template: 'chat'", "search, direct, tir"),
    ("data.limit=0", "data.limit: 0", ">= 1, or null"),
    ("data.shuffle_seed=-1", "data.shuffle_seed: -1", ">= 0"),
    ("rollout.group_size=0", "rollout.group_size: 0", ">= 2"),
    ("rollout.group_size=1", "rollout.group_size: 1", "no baseline"),
    ("rollout.max_turns=-1", "rollout.max_turns: -1", ">= 0"),
    ("rollout.max_response_tokens=0", "rollout.max_response_tokens: 0", ">= 1"),
    ("rollout.max_obs_tokens=0", "rollout.max_obs_tokens: 0", ">= 1"),
    ("rollout.tool_timeout_s=0", "rollout.tool_timeout_s: 0.0", "> 0"),
    ("rollout.temperature=-0.5", "rollout.temperature: -0.5", ">= 0"),
    ("rollout.top_p=0", "rollout.top_p: 0.0", "(0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p: 1.5", "(0, 1]"),
    ("rollout.top_k=-1", "rollout.top_k: -1", ">= 0"),
    ("tools.retriever=''", "tools.retriever: ''", "world"),
    ("tools.topk=0", "tools.topk: 0", ">= 1"),
    ("tools.code_timeout_s=0", "tools.code_timeout_s: 0.0", "> 0"),
    ("reward.b1=0", "reward.b1: 0.0", "> 0"),
    ("reward.b2=-1", "reward.b2: -1.0", "> 0"),
    ("reward.weight=0", "reward.weight: 0.0", "(0, 1]"),
    ("reward.weight=1.5", "reward.weight: 1.5", "(0, 1]"),
    ("reward.format_penalty=-0.1", "reward.format_penalty: -0.1", ">= 0"),
    ("rl.steps=-3", "rl.steps: -3", ">= 0"),
    ("rl.steps=0", "rl.steps: 0", "0 with sft.steps >= 1"),
    ("rl.prompts_per_step=0", "rl.prompts_per_step: 0", ">= 1"),
    ("rl.mini_batch=-1", "rl.mini_batch: -1", ">= 0"),
    ("rl.micro_batch=-4", "rl.micro_batch: -4", ">= 0"),
    ("rl.epochs=0", "rl.epochs: 0", ">= 1"),
    # 512 prompts x 5 = 2560 trajectories a step: 7 does not divide them, 3 not the mini-batch
    ("rl.mini_batch=7", "rl.mini_batch: 7", "divisor of the 2560 trajectories"),
    (["rl.mini_batch=1280", "rl.micro_batch=300"], "rl.micro_batch: 300", "divisor of the mini-batch (1280)"),
    (["rl.micro_batch=10", "mesh.fsdp=4"], "rl.micro_batch: 10", "multiple of mesh.fsdp=4"),
    ("rl.loss.clip_low=-0.1", "rl.loss.clip_low: -0.1", "[0, 1)"),
    ("rl.loss.clip_low=1", "rl.loss.clip_low: 1.0", "[0, 1)"),
    ("rl.loss.clip_high=-0.2", "rl.loss.clip_high: -0.2", ">= 0"),
    ("rl.loss.kl_coef=-0.001", "rl.loss.kl_coef: -0.001", ">= 0"),
    ("rl.loss.entropy_coef=-0.1", "rl.loss.entropy_coef: -0.1", ">= 0"),
    ("rl.loss.log_ratio_clamp=0", "rl.loss.log_ratio_clamp: 0.0", "> 0"),
    ("rl.loss.dual_clip=1", "rl.loss.dual_clip: 1.0", "> 1"),
    ("rl.optim.lr=0", "rl.optim.lr: 0.0", "> 0"),
    ("rl.optim.lr=-1e-6", "rl.optim.lr: -1e-06", "> 0"),
    ("rl.optim.warmup_steps=-1", "rl.optim.warmup_steps: -1", ">= 0"),
    ("rl.optim.total_steps=0", "rl.optim.total_steps: 0", ">= 1"),
    ("rl.optim.min_lr_ratio=1.5", "rl.optim.min_lr_ratio: 1.5", "[0, 1]"),
    ("rl.optim.b1=1", "rl.optim.b1: 1.0", "[0, 1)"),
    ("rl.optim.b2=-0.1", "rl.optim.b2: -0.1", "[0, 1)"),
    ("rl.optim.eps=0", "rl.optim.eps: 0.0", "> 0"),
    ("rl.optim.weight_decay=-0.01", "rl.optim.weight_decay: -0.01", ">= 0"),
    ("rl.optim.grad_clip=-1", "rl.optim.grad_clip: -1.0", ">= 0"),
    ("sft.steps=-1", "sft.steps: -1", ">= 0"),
    ("sft.steps=5", "sft.data: None", "when sft.steps=5 > 0"),
    ("sft.batch=0", "sft.batch: 0", ">= 1"),
    ("sft.lr=0", "sft.lr: 0.0", "> 0"),
    ("run.dir=''", "run.dir: ''", "folder"),
    ("run.checkpoint_every=0", "run.checkpoint_every: 0", ">= 1"),
    ("run.keep=0", "run.keep: 0", ">= 1"),
]

EVAL_BAD = [
    ("seed=-2", "seed: -2", ">= 0"),
    ("batch_size=0", "batch_size: 0", ">= 1"),
    ("model.dtype=half", "model.dtype: 'half'", "float32"),
    ("data.path=''", "data.path: ''", "world"),
    ("data.limit=0", "data.limit: 0", ">= 1"),
    ("output.n_boot=-1", "output.n_boot: -1", ">= 0"),
    ("episode.max_response_tokens=0", "episode.max_response_tokens: 0", ">= 1"),
    ("episode.top_p=2", "episode.top_p: 2.0", "(0, 1]"),
    ("tools.topk=0", "tools.topk: 0", ">= 1"),
]


def _message(cls, overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cls, None, [overrides] if isinstance(overrides, str) else overrides)
    return str(e.value)


@pytest.mark.parametrize("cls, overrides, start, expected",
                         [(TrainConfig, *case) for case in TRAIN_BAD] + [(EvalConfig, *case) for case in EVAL_BAD],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_out_of_range_names_key_value_and_expectation(cls, overrides, start, expected):
    msg = _message(cls, overrides)
    assert msg.startswith(start + " ") and expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize("cls, overrides", [
    (TrainConfig, ["rollout.group_size=2", "rl.prompts_per_step=1", "rl.steps=1", "rl.epochs=1"]),
    (TrainConfig, ["rl.loss.clip_low=0", "rl.loss.clip_high=0", "rl.loss.kl_coef=0", "rl.optim.grad_clip=0",
                   "rl.optim.warmup_steps=0", "rl.optim.min_lr_ratio=1", "rl.optim.b1=0", "rollout.max_turns=0"]),
    (TrainConfig, ["sft.steps=0", "sft.data=null", "data.limit=1", "seed=0", "rollout.temperature=0",
                   "rollout.top_p=1", "rollout.top_k=0", "reward.weight=1", "reward.format_penalty=0"]),
    (TrainConfig, ["mesh.fsdp=-1", "mesh.tp=2", "mesh.devices=0", "model.dtype=bf16", "model.param_dtype=bfloat16"]),
    (TrainConfig, ["rl.prompts_per_step=4", "rollout.group_size=3", "rl.mini_batch=6", "rl.micro_batch=2",
                   "mesh.fsdp=2"]),
    (TrainConfig, ["rl.micro_batch=5", "mesh.fsdp=4", "mesh.devices=1"]),  # one device: no mesh to split over
    (EvalConfig, ["batch_size=1", "output.n_boot=0", "data.limit=1", "model.dtype=float16", "episode.max_turns=0"]),
])
def test_values_at_the_edges_load(cls, overrides):
    cfg = load_config(cls, None, overrides)
    assert isinstance(cfg, cls)


DEVICES = [f"dev{i}" for i in range(8)]


@pytest.mark.parametrize("mesh, picked", [
    (MeshConfig(), 8), (MeshConfig(devices=1), 1), (MeshConfig(fsdp=2, tp=2, devices=4), 4),
    (MeshConfig(fsdp=-1, tp=4), 8), (MeshConfig(fsdp=3, devices=1), 1),  # one device: fsdp unused
])
def test_mesh_picks_the_first_devices(mesh, picked):
    assert mesh.pick(DEVICES) == DEVICES[:picked]


def test_mesh_devices_beyond_the_machine_fail():
    with pytest.raises(ConfigError) as e:
        MeshConfig(devices=9).pick(DEVICES)
    msg = str(e.value)
    assert msg.startswith("mesh.devices: 9 devices") and "only 8 are available" in msg


@pytest.mark.parametrize("mesh", [MeshConfig(fsdp=3), MeshConfig(fsdp=2, tp=2), MeshConfig(fsdp=-1, tp=3),
                                  MeshConfig(fsdp=4, devices=2)])
def test_mesh_axes_that_do_not_fit_the_devices_fail(mesh):
    with pytest.raises(ConfigError, match=rf"^mesh\.fsdp: fsdp={mesh.fsdp} x tp={mesh.tp} does not fit"):
        mesh.pick(DEVICES)
