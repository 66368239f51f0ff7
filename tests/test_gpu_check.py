"""benchmarks/gpu_check.py cannot rot: every section of the device check runs here at tiny
shapes on the CPU (the plain policy forced, as on an accelerator) and asserts the same
properties it asserts on a GPU: car_jax's fp32 logits and greedy tokens are transformers';
flash attention (and the fused one's wiring) equals dense, values and gradients, fp32 and
bf16, with GQA, padding and a cache offset; every decode row samples its tokens; the train
step is the same with remat on and off; bounded slots give the episodes of all at once; the
recipe's training unit runs through the trainer. Then the runner itself: a section past its
time box is reported as a timeout with its partial results and the next section still runs;
the JSON file is strict JSON; the old section names still work."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.device_check import SECTIONS, attention, decode, parity, runner, train_step
from benchmarks.device_check.common import Options
from car_jax.train import flops

ROOT = Path(__file__).resolve().parents[1]


def _run(name, tmp_path):
    """One section in this process at tiny shapes: (result, the partial results it sent)."""
    parts = {}
    result = SECTIONS[name].run(Options(tiny=True, work=tmp_path), parts.__setitem__)
    assert result["checks"], name
    failed = {k: c for k, c in result["checks"].items() if not c["ok"]}
    assert not failed, failed
    assert runner.status_of(result) == "ok"
    assert isinstance(SECTIONS[name].summary(result), str)
    json.dumps(runner.clean(result), allow_nan=False)  # what the JSON file gets
    return result, parts


def test_parity_with_transformers(tmp_path):
    pytest.importorskip("torch")
    r, parts = _run("parity", tmp_path)
    assert r["policy"] == "plain"  # forced on the CPU, as load_model picks it on an accelerator
    assert r["logits"]["max_abs_diff"] <= parity.PARITY_TOL * r["logits"]["logit_scale"]
    assert r["greedy"]["rows_equal"] == r["greedy"]["rows"] == len(parity.TINY.greedy_lengths)
    assert "logits" in parts


def test_flash_and_fused_attention_equal_dense(tmp_path):
    r, parts = _run("attention", tmp_path)
    assert set(parts) == set(attention.TINY.cases) == {"causal", "cache_offset"}
    for case in attention.TINY.cases:
        for arr in ("out", "dq", "dk", "dv"):
            fp32 = r["checks"][f"{case}/float32/blockwise/{arr}"]
            assert fp32["value"] <= fp32["limit"] < 1e-3  # FP32_TOL x max(1, |dense|): values are O(1) here
            for variant in ("blockwise", "fused_xla"):  # on a GPU: blockwise and cudnn
                assert r["checks"][f"{case}/bfloat16/{variant}/{arr}"]["ok"]
            assert r["errors"][f"{case}/bfloat16/dense"][arr] > 0  # bf16 rounds: the bound is not vacuous
    assert attention.TINY.heads[1] > 1  # GQA


def test_decode_rows_and_bandwidth(tmp_path):
    r, _ = _run("decode", tmp_path)
    assert r["policy"] == "plain" and r["decode_stages"] == 1
    assert r["weight_bytes"] == 2 * r["params"]  # bf16, tied: every weight is read once a step
    for rows in decode.TINY.batches:
        b = r["batches"][str(rows)]
        assert b["steps"] == decode.TINY.new and b["tokens_per_s"] > 0
        assert b["kv_bytes"] > 0 and b["bytes_per_step"] == r["weight_bytes"] + b["kv_bytes"]
        assert math.isnan(b["hbm_fraction"])  # a CPU is not in the chip table


def test_the_chip_table_has_bandwidths():
    assert flops.chip("NVIDIA H200").hbm_bytes_per_s == 4.8e12
    assert flops.chip("NVIDIA H100 80GB HBM3").hbm_bytes_per_s == 3.35e12
    assert all(c.hbm_bytes_per_s > 0 for c in flops.CHIPS.values())


def test_train_step_remat_on_equals_off(tmp_path):
    r, parts = _run("train_step", tmp_path)
    off, on = r["settings"]["remat_off"], r["settings"]["remat_on"]
    assert set(parts) == {"remat_off", "remat_on"}
    assert abs(on["loss"] - off["loss"]) <= train_step.REMAT_TOL * max(1.0, abs(off["loss"]))
    assert off["grad_norm"] > 0 and on["tokens"] == off["tokens"] > 0
    assert math.isnan(off["mfu"]) and off["model_tflop"] > 0


def test_bounded_slots_give_the_episodes_of_all_at_once(tmp_path):
    r, _ = _run("engine", tmp_path)
    assert r["first_different"] == -1 and r["bounded"]["slots"] < r["episodes"]
    assert r["bounded"]["sampled_tokens"] == r["all_at_once"]["sampled_tokens"] > 0
    assert len(r["turns_seen"]) >= 2


def test_the_recipe_runs_through_the_trainer(tmp_path):
    r, parts = _run("recipe", tmp_path)
    assert r["config"] == "configs/experiment/world_car_gpu.yaml" and r["unit"] == "train/car-s0"
    assert r["recipe_steps"] == 60  # the shipped recipe's run, which the estimate scales to
    assert [s["step"] for s in r["steps"]] == [1, 2] and set(parts) == {"step_1", "step_2"}
    assert r["steady_step_s"] > 0


def test_old_section_names_and_boxes():
    assert gpu_check.section_names("parity,greedy,generate,grpo") == ["parity", "decode", "recipe"]
    assert gpu_check.boxes(["decode=30", "grpo=5"]) == {"decode": 30.0, "recipe": 5.0}
    with pytest.raises(SystemExit):
        gpu_check.section_names("nope")
    assert set(runner.FULL_BOXES) == set(runner.TINY_BOXES) == set(SECTIONS)
    assert runner.FULL_BUDGET < 8 * 60  # every wait is cut to the budget: the 8 minutes hold


def test_a_section_past_its_box_is_reported_and_the_next_runs(tmp_path):
    """The whole script in a process of its own, as users run it: `_sleep` never ends, is
    killed at its 3 s box with its partial result kept, and attention runs after it in a
    fresh process; the exit status says a section did not pass."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny",
                           "--sections", "_sleep,attention", "--box", "_sleep=3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    record = json.loads(out.read_text())  # strict JSON: no NaN
    slept, attn = record["sections"]["_sleep"], record["sections"]["attention"]
    assert slept["status"] == "timeout" and slept["parts"] == {"sleeping": True} and slept["box_s"] == 3
    assert attn["status"] == "ok" and attn["checks"]
    assert record["shapes"] == "tiny" and record["device"]["backend"] == "cpu"
    assert "[gpu_check] _sleep: timeout" in proc.stdout and "| attention | ok |" in proc.stdout
