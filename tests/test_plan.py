"""car_jax.plan: the planner's byte counts against counts made here from the param tree and
against XLA's `memory_analysis()` of the real compiled programs (fake CPU mesh), the CLI's
JSON, and its errors."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.cli import main
from car_jax.config import load_config
from car_jax.models.config import ModelConfig
from car_jax.models.decoder import Decoder
from car_jax.plan import fit_document, make_plan, model_config, plan_config, shipped_models
from car_jax.plan.fit import chip_from_name
from car_jax.plan.memory import PlanError
from car_jax.plan.xla import abstract_params, fake_mesh, xla_memory
from car_jax.train import flops
from car_jax.train.config import TrainConfig

TINY = ModelConfig("qwen2", 2048, 128, 2, 4, 2, 32, 384, qkv_bias=True)
WIDE_KV = ModelConfig("qwen3", 2048, 128, 2, 8, 4, 16, 384, qk_norm=True, tie_embeddings=True)  # tp up to 4
SMALL = ["rollout.group_size=4", "rl.prompts_per_step=8", "rl.micro_batch=16", "rollout.max_turns=1",
         "rollout.max_response_tokens=64", "rollout.max_obs_tokens=32", "model.dtype=float32"]


def tiny_cfg(*overrides):
    return load_config(TrainConfig, None, [*SMALL, *overrides])


def test_param_bytes_match_the_param_tree_split_by_jax():
    """params / grads / moments / reference: numpy's count of each leaf's shard as jax lays it
    out on the mesh (NamedSharding.shard_shape), times the storage dtype."""
    mesh = fake_mesh(2, 2)
    tree = abstract_params(Decoder(TINY, param_dtype=jnp.float32), mesh)
    by_hand = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(tree)) * 4
    plan = make_plan(tiny_cfg("model.param_dtype=float32"), 2, 2, "v5e", prompt_tokens=64, model=TINY)
    assert plan.params_bytes == by_hand
    assert plan.opt_state_bytes == plan.grads_bytes == 2 * by_hand and plan.ref_bytes == by_hand
    assert make_plan(tiny_cfg("rl.loss.kl_coef=0"), 2, 2, "v5e", prompt_tokens=64, model=TINY).ref_bytes == 0


SLOTS = 64 + 2 * 64 + 1 * 48  # prompt + 2 turns x 64 + one observation chunk (1 + 32 -> 48)


def cache_row(slots: int = SLOTS, cb: int = 2) -> int:
    """One row of TINY's cache on a device (tp=1): keys and values [L, K, S, H], slot flags [S]."""
    return 2 * TINY.n_layers * TINY.n_kv_heads * slots * TINY.head_dim * cb + slots


def test_kv_cache_bytes_by_hand():
    plan = make_plan(tiny_cfg("model.dtype=bfloat16"), 2, 1, "v5e", prompt_tokens=64, model=TINY)
    assert plan.shapes.capacity == SLOTS
    assert plan.kv_cache_bytes == 32 // 2 * cache_row()


@pytest.mark.parametrize("overrides,rows,narrow", [
    ([], 32, 16),  # every episode at once: no park; half of 32 decode rows
    (["rollout.max_concurrent=16"], 16, 6),  # 32 episodes > 16 rows: park 16 // 4 = 4, half of 12 decode rows
    (["rollout.max_concurrent=16", "rollout.park_slots=0"], 16, 8),
], ids=["all-at-once", "park-a-quarter", "no-park"])
def test_narrowing_tail_counted_by_hand(overrides, rows, narrow):
    """The engine's tail allocates a cache of half the decode rows (and its float32 logits
    [rows, V]) before it frees the wider one: the planner's KV peak holds both, the rollout
    phase the larger of that copy and a program's temporaries with the gathered weights. With
    no park the KV peak is 1.5 x the rows' cache (+ the logits)."""
    fsdp = 2
    plan = make_plan(tiny_cfg("model.dtype=bfloat16", *overrides), fsdp, 1, "v5e", prompt_tokens=64, model=TINY)
    assert (plan.shapes.rollout_rows, plan.shapes.narrow_rows) == (rows, narrow)
    assert plan.kv_cache_bytes == rows // fsdp * cache_row()
    assert plan.narrowing_bytes == narrow // fsdp * (cache_row() + TINY.vocab_size * 4)
    assert plan.kv_peak_bytes == (rows + narrow) // fsdp * cache_row() + narrow // fsdp * TINY.vocab_size * 4
    if narrow == rows // 2:
        assert plan.kv_peak_bytes - narrow // fsdp * TINY.vocab_size * 4 == 1.5 * plan.kv_cache_bytes
    held = plan.params_bytes + plan.opt_state_bytes + plan.ref_bytes
    program = plan.gathered_bytes + plan.rollout_temp_bytes
    assert plan.rollout_bytes == held + plan.kv_cache_bytes + max(program, plan.narrowing_bytes)


def test_narrowing_tail_sets_the_paper_configs_rollout_phase():
    """Qwen2.5-3B on a v5p-8, 512 rows of 5,060 slots (2,560 episodes: 128 park, 384 decode):
    the tail's copy of 192 rows outweighs the widest prefill with its gathered weights, so the
    rollout phase is the weights, the moments, the reference and 704 rows of cache, 192 of
    them with their logits."""
    plan = plan_config(Path(__file__).resolve().parents[1] / "configs" / "fit" / "qwen2.5-3b_v5p-8.yaml")
    c, sh = model_config(load_config(TrainConfig, "configs/fit/qwen2.5-3b_v5p-8.yaml").model.path), plan.shapes
    assert (sh.rollout_rows, sh.capacity, sh.decode_rows, sh.narrow_rows) == (512, 5060, 384, 192)
    row = 2 * c.n_layers * c.n_kv_heads * sh.capacity * c.head_dim * 2 + sh.capacity  # bf16 keys and values, flags
    held = plan.params_bytes + plan.opt_state_bytes + plan.ref_bytes
    assert plan.narrowing_bytes > plan.gathered_bytes + plan.rollout_temp_bytes
    assert plan.rollout_bytes == held + (512 + 192) // 4 * row + 192 // 4 * c.vocab_size * 4


@pytest.mark.parametrize("model,fsdp,tp,overrides", [
    (TINY, 1, 1, ["model.remat=true"]),
    (TINY, 1, 2, ["model.remat=false"]),
    (WIDE_KV, 1, 4, ["model.remat=true", "rl.loss.kl_coef=0"]),
], ids=["1x1-remat", "1x2-no-remat", "1x4-remat-no-kl-qwen3"])
def test_plan_agrees_with_xla_memory_analysis(model, fsdp, tp, overrides):
    """The train step's peak (arguments + outputs - aliased + temporaries) and the rollout
    programs' within 15% of the planner's figures for the same parts."""
    cfg = tiny_cfg(*overrides)
    plan = make_plan(cfg, fsdp, tp, "v5e", prompt_tokens=64, model=model)
    xla = xla_memory(cfg, model, fake_mesh(fsdp, tp), plan.shapes)
    step = plan.params_bytes + plan.opt_state_bytes + plan.grads_bytes + plan.activation_bytes
    assert step == pytest.approx(xla["train_step"].peak, rel=0.15)
    assert xla["train_step"].argument >= plan.params_bytes + plan.opt_state_bytes  # the state is an argument
    rollout = plan.params_bytes + plan.kv_cache_bytes + plan.rollout_temp_bytes
    assert rollout == pytest.approx(max(xla["prefill"].peak, xla["decode"].peak), rel=0.15)


@pytest.mark.parametrize("fsdp,tp,overrides", [
    (4, 1, ["model.remat=true"]),
    (2, 2, ["model.remat=false"]),
], ids=["4x1-remat", "2x2-no-remat"])
def test_plan_agrees_with_xla_train_step_over_fsdp(fsdp, tp, overrides):
    """With rows split over fsdp the train step's and the rollout prefill's peaks are within
    15% of the planner's: the forwards keep each device's rows only
    (`sharding.rows_constraint`; without it XLA holds about twice the planner's figure for
    the train step and 1.7x for the prefill on 4x1), and each layer's and the head's weights
    are gathered whole, with their gradients in the train step (`memory.gathered_bytes`,
    counted by hand here: one layer's params and the head's, D whole, 1/tp of the rest)."""
    cfg = tiny_cfg(*overrides)
    plan = make_plan(cfg, fsdp, tp, "v5e", prompt_tokens=64, model=TINY)
    c, f = TINY, 4  # float32 params
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # q, k, v weights and biases, split over tp
    layer = (c.d_model * qkv + qkv + c.n_heads * c.head_dim * c.d_model + 3 * c.d_model * c.mlp_dim) // tp
    layer += 2 * c.d_model  # the two norms, whole
    head = c.d_model * c.vocab_size // tp  # lm_head [D, V / tp]
    assert plan.gathered_bytes == (layer + head) * f
    xla = xla_memory(cfg, TINY, fake_mesh(fsdp, tp), plan.shapes, programs=("train_step", "prefill"))
    step = plan.params_bytes + plan.opt_state_bytes + plan.grads_bytes + 2 * plan.gathered_bytes + plan.activation_bytes
    assert step == pytest.approx(xla["train_step"].peak, rel=0.15)
    prefill = plan.params_bytes + plan.gathered_bytes + plan.kv_cache_bytes + plan.rollout_temp_bytes
    assert prefill == pytest.approx(xla["prefill"].peak, rel=0.15)


def test_cli_json_has_the_keys(capsys):
    rc = main(["plan", "--config", "configs/qwen2.5-3b_car_mscr.yaml", "--mesh", "fsdp=4,tp=1", "--chip", "v5p",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    keys = {"params_bytes", "grads_bytes", "opt_state_bytes", "ref_bytes", "kv_cache_bytes", "activation_bytes",
            "total_bytes", "hbm_bytes", "fits", "flops_per_step"}
    assert keys <= set(out)
    assert out["hbm_bytes"] == 95 * 2**30 and out["total_bytes"] == max(out["train_bytes"], out["rollout_bytes"])
    assert out["fits"] == (out["total_bytes"] <= 0.9 * out["hbm_bytes"])


def test_shipped_config_found_by_hub_id_and_placeholder_name():
    hub = model_config("Qwen/Qwen2.5-3B-Instruct")
    assert hub == model_config("/path/to/Qwen2.5-3B-Instruct")
    assert hub == model_config("Qwen/Qwen2.5-3B-Instruct@main")  # model.path's hub form with a revision
    assert model_config("Qwen/Qwen3-8B@refs/pr/1") != hub
    assert (hub.d_model, hub.n_layers, hub.n_heads, hub.n_kv_heads, hub.tie_embeddings) == (2048, 36, 16, 2, True)


@pytest.mark.parametrize("args,message", [
    (["--mesh", "fsdp=4", "--chip", "tpu9"], "unknown chip 'tpu9'"),
    (["--mesh", "fsdp=3"], "does not split over fsdp=3"),
    (["--mesh", "tp=4"], "does not split over tp=4"),  # Qwen2.5-3B has 2 kv heads
    (["--mesh", "fsdp=two"], "is not fsdp=N or tp=N"),
    (["--mesh", "fsdp=4", "model.path=/nowhere/NoSuchModel"], "no shipped config.json for 'NoSuchModel'"),
])
def test_cli_errors_name_the_bad_value(capsys, args, message):
    rc = main(["plan", "--config", "configs/qwen2.5-3b_car_mscr.yaml", *args])
    assert rc == 2 and message in capsys.readouterr().err


def test_unknown_chip_and_bad_mesh_raise():
    with pytest.raises(ValueError, match="unknown chip"):
        make_plan(tiny_cfg(), 1, 1, "v7x", model=TINY)
    with pytest.raises(PlanError, match="kv_heads=2"):
        make_plan(tiny_cfg(), 1, 4, "v5e", model=TINY)


FIT = sorted((Path(__file__).resolve().parents[1] / "configs" / "fit").glob("*.yaml"))


def hand_param_count(c) -> tuple[int, int]:
    """(all parameters, those without a D axis) of a Qwen2 / Qwen3 decoder from its config:
    embedding (and lm_head when untied), per layer q / k / v / o, the qkv biases (Qwen2) or
    q / k norms (Qwen3), the gated MLP and two norms; the final norm. The second count (norms,
    biases) is not split over fsdp: every device holds it whole."""
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    small = 2 * c.d_model + (qkv if c.qkv_bias else 0) + (2 * c.head_dim if c.qk_norm else 0)
    layer = c.d_model * qkv + c.n_heads * c.head_dim * c.d_model + 3 * c.d_model * c.mlp_dim + small
    whole = c.n_layers * small + c.d_model
    return c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2) + c.n_layers * layer + c.d_model, whole


def test_there_is_a_fit_config_for_every_shipped_model_and_chip_kind():
    models = {model_config(load_config(TrainConfig, p).model.path) for p in FIT}
    assert models == {model_config(hub) for hub in shipped_models()}
    assert {chip_from_name(p) for p in FIT} == {"v5e", "v5p", "v6e", "h100", "h200"}


@pytest.mark.parametrize("path", FIT, ids=lambda p: p.stem)
def test_fit_config_fits_its_chips(path):
    """Each configs/fit/ file loads, splits its batches over its mesh, and fits the chip its
    name names by the planner; its params per device are the hand count over the mesh."""
    cfg = load_config(TrainConfig, path)
    rl, f = cfg.rl, cfg.mesh.fsdp
    assert cfg.mesh.tp == 1 and f > 1  # every shipped fit config is pure fsdp: its params split f ways
    assert rl.prompts_per_step * cfg.rollout.group_size % rl.mini_batch == 0 and rl.mini_batch % rl.micro_batch == 0
    assert rl.micro_batch % f == 0 and cfg.rollout.max_concurrent % f == 0
    plan = plan_config(path)
    assert plan.fits and plan.total_bytes <= 0.9 * flops.chip_named(chip_from_name(path)).hbm_bytes
    total, whole = hand_param_count(model_config(cfg.model.path))
    assert plan.params_bytes * f == 4 * (total + (f - 1) * whole)  # float32; norms and biases on every device


def test_docs_plan_is_the_generated_table():
    """docs/PLAN.md is what `car-jax plan --table configs/fit` prints now (regenerate it
    after changing a fit config or the planner)."""
    root = Path(__file__).resolve().parents[1]
    assert (root / "docs" / "PLAN.md").read_text() == fit_document(root / "configs" / "fit")


def test_table_errors_name_the_bad_value(tmp_path, capsys):
    with pytest.raises(PlanError, match="got 'tpu9'"):
        chip_from_name("configs/fit/qwen2.5-3b_tpu9-8.yaml")
    with pytest.raises(PlanError, match="ends with _<chip>-<n>"):
        chip_from_name("qwen.yaml")
    assert main(["plan", "--table", str(tmp_path)]) == 2 and "no .yaml configs there" in capsys.readouterr().err
    (tmp_path / "tiny_v5e-1.yaml").write_text("mesh:\n  fsdp: -1\n")
    assert main(["plan", "--table", str(tmp_path)]) == 2 and "names its mesh sizes" in capsys.readouterr().err


def test_chip_named_in_a_config_file_name():
    from car_jax.plan.fit import chip_in_name

    assert chip_in_name("configs/fit/qwen2.5-7b_h100-8.yaml") == "h100"
    assert chip_in_name("configs/qwen2.5-32b_car_mscr_v5p128.yaml") == "v5p"
    assert chip_in_name("my_h100-pcie-8.yaml") == "h100-pcie"
    assert chip_in_name("configs/qwen2.5-3b_car_mscr.yaml") is None and chip_in_name("tiny_test.yaml") is None


def test_cli_without_chip_reads_the_config_name_else_says_what_it_assumes(capsys):
    """No --chip: an H100 config is planned on an H100 (not on the v5p default), said in one
    line on stderr; a config whose file name names no chip gets v5p, said likewise; --chip
    given: nothing on stderr."""
    assert main(["plan", "--config", "configs/fit/qwen2.5-7b_h100-8.yaml", "--json"]) == 0
    out, err = capsys.readouterr()
    assert (json.loads(out)["chip"], json.loads(out)["hbm_bytes"]) == ("h100", 80e9)
    assert err.count("\n") == 1 and err.startswith("car-jax plan: chip h100, named by the config's file name")
    args = ["plan", "--config", "configs/qwen2.5-3b_car_mscr.yaml", "--mesh", "fsdp=4", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert (json.loads(out)["chip"], json.loads(out)["hbm_bytes"]) == ("v5p", 95 * 2**30)
    assert err.count("\n") == 1 and "no --chip given" in err and "assuming v5p" in err
    assert main([*args, "--chip", "h200"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["chip"] == "h200" and err == ""
