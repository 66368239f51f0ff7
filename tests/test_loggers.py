"""run.loggers (issue 34, item 3): metrics.jsonl always, TensorBoard and Weights & Biases on request.

The W&B runs are offline (WANDB_MODE=offline, every W&B folder under tmp_path, no network) and
are read back with wandb's own reader of its transaction log, `wandb leet inspect --json` (one
JSON object per record: the run's config, one "history" record per step), plus the table files
the history records point to (files/media/table/*.table.json). The TensorBoard text is read
from the event files with tensorboardX's protobufs."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from car_jax.config import ConfigError, dump_config, load_config, save_config
from car_jax.train.config import RunConfig, TrainConfig
from car_jax.train.log import MetricsLogger, read_metrics
from car_jax.train.loggers import SAMPLE_COLUMNS, Sample, WandbConfig, import_wandb, samples_markdown

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B in offline mode with none of the caller's settings, its caches under tmp_path."""
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc key, no ~/.config/wandb settings
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
           "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_ARTIFACT_DIR": str(home / "artifacts")}
    for var, value in env.items():
        monkeypatch.setenv(var, value)


def wandb_run(folder) -> tuple[dict, dict[int, dict], dict]:
    """The one offline run under `folder` (a wandb folder holding offline-run-*), read with
    wandb's reader: (its files folder, {step: history item}, its `--summary` object)."""
    runs = sorted(folder.glob("offline-run-*"))
    assert len(runs) == 1, runs

    def inspect(*flags):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(runs[0])],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    records = [json.loads(line) for line in inspect().splitlines() if line.strip()]
    history = {}
    for r in records:
        if r["type"] == "history":
            step = int(r["history"]["step"]["num"])
            assert step not in history, f"step {step} logged twice"
            history[step] = {k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                             for k, v in r["history"]["item"].items()}
    return runs[0] / "files", history, json.loads(inspect("--summary"))


def table(files, item: dict, key: str = "samples") -> tuple[list, list]:
    """(columns, rows) of the wandb.Table logged under `key` in a history item."""
    assert item[f"{key}._type"] == "table-file"
    data = json.loads((files / item[f"{key}.path"]).read_text())
    return data["columns"], data["data"]


def same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def tb_texts(run_dir) -> dict[str, list[tuple[int, str]]]:
    """Text summaries of tensorboardX event files (TFRecord framing): tag -> [(step, text)]."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, str]]] = {}
    for f in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4  # length, length crc, payload, payload crc
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "text":
                    out.setdefault(v.tag, []).append((event.step, v.tensor.string_val[0].decode()))
    return out


SAMPLES = [Sample("What is 2 + 2?", "<search> 2 + 2 </search>\n<answer> 4 </answer> <confidence> 0.9 </confidence>",
                  "4 | four", 1.25, True, 0.9),
           Sample("Who | what?", "", "x", -0.5, False, 0.0)]


def test_wandb_offline_run_holds_the_steps_config_and_samples(tmp_path, offline_wandb, monkeypatch):
    """A resumed run's steps 5..7 (samples at 5 and 7): W&B holds the metrics.jsonl values at
    the training steps, NaN and inf too, the config once, and each step's samples table; the
    files go to $WANDB_DIR, the run is named and tagged from run.wandb."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    run_dir = tmp_path / "run"
    config = {"seed": 3, "rl": {"optim": {"lr": 1e-6}, "steps": 7}, "run": {"loggers": ["wandb"], "dir": str(run_dir)}}
    logged = {5: ({"reward": 0.5, "kl": np.float32(0.25), "n": 3, "time/step": 1.5}, SAMPLES),
              6: ({"reward": float("nan"), "kl": float("inf"), "n": 4, "time/step": 2.0}, ()),
              7: ({"reward": -1.0, "kl": 0.125, "n": 5, "time/step": 0.5}, SAMPLES[::-1])}
    with MetricsLogger(run_dir, loggers=("wandb",), config=config,
                       wandb=WandbConfig(project="car-test", name="tiny", tags=("a", "b"))) as log:
        for step, (metrics, samples) in logged.items():
            log.log(step, metrics, samples=samples)
    assert not (run_dir / "tb").exists() and not (run_dir / "wandb").exists()  # only the loggers asked for, at $WANDB_DIR
    files, history, summary = wandb_run(tmp_path / "wb" / "wandb")
    assert sorted(history) == [5, 6, 7]
    for record in read_metrics(run_dir):
        item = history[record["step"]]
        metrics = {k: v for k, v in record.items() if k not in ("step", "time")}
        assert set(metrics) == {k for k in item if not k.startswith(("_", "samples."))}
        assert all(same(float(item[k]), float(v)) for k, v in metrics.items()), (item, metrics)
    assert math.isnan(history[6]["reward"]) and history[6]["kl"] == math.inf
    assert not any(k.startswith("samples.") for k in history[6])  # no samples, no table
    for step in (5, 7):
        columns, rows = table(files, history[step])
        assert columns == list(SAMPLE_COLUMNS) == ["prompt", "response", "gold", "reward", "correct", "confidence"]
        assert rows == [list(dataclasses.astuple(s)) for s in logged[step][1]]
    assert summary["config"] == config and summary["state"] == "finished"
    assert (summary["project"], summary["name"], summary["tags"]) == ("car-test", "tiny", ["a", "b"])


def test_tensorboard_holds_the_samples_as_text(tmp_path):
    with MetricsLogger(tmp_path, loggers=("tensorboard",)) as log:
        log.log(1, {"reward": 0.5}, samples=SAMPLES)
        log.log(2, {"reward": 0.25})
    [(step, text)] = tb_texts(tmp_path)["samples/text_summary"]
    assert step == 1 and text == samples_markdown(SAMPLES)
    lines = text.splitlines()
    assert lines[0] == "| prompt | response | gold | reward | correct | confidence |" and len(lines) == 2 + len(SAMPLES)
    # one table row per sample: the response's tags escaped, its newline a <br>, pipes escaped
    assert lines[2] == ("| What is 2 + 2? | &lt;search&gt; 2 + 2 &lt;/search&gt;<br>&lt;answer&gt; 4 &lt;/answer&gt; "
                        "&lt;confidence&gt; 0.9 &lt;/confidence&gt; | 4 \\| four | 1.25 | true | 0.9 |")
    assert lines[3] == "| Who \\| what? |  | x | -0.5 | false | 0 |"


def test_a_training_run_logs_its_steps_and_samples_to_both(tmp_path, offline_wandb):
    """A tiny GRPO run (the chance task on builtin:tiny-random, 2 steps of 2 prompts x G=2)
    with run.loggers=[tensorboard,wandb]: W&B's history is metrics.jsonl step for step, its
    config the saved one, and each step's table holds the step's trajectories, whose rewards,
    grades and confidences average to the step's reward, accuracy and confidence metrics;
    the W&B files sit in run.dir/wandb (no $WANDB_DIR)."""
    from car_jax.train.trainer import train

    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [
        "model.path=builtin:tiny-random", "mesh.devices=1", "data.train=chance", "data.template=chance",
        "rollout.group_size=2", "rollout.max_turns=0", "rollout.max_response_tokens=8", "sft.steps=0",
        "rl.steps=2", "rl.prompts_per_step=2", "rl.loss.kl_coef=0", f"run.dir={run_dir}", "run.export_hf=false",
        "run.loggers=[tensorboard, wandb]", "run.samples_per_step=4", "run.wandb.project=car-test"])
    rows = train(cfg)
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in metrics] == [1, 2]
    files, history, summary = wandb_run(run_dir / "wandb")
    assert sorted(history) == [1, 2]
    for record in metrics:
        item = history[record["step"]]
        assert all(same(float(item[k]), float(v)) for k, v in record.items() if k not in ("step", "time"))
        columns, samples = table(files, item)
        assert columns == list(SAMPLE_COLUMNS) and len(samples) == 4  # every row of the step
        reward, correct, confidence = (np.array([s[columns.index(c)] for s in samples], np.float64)
                                       for c in ("reward", "correct", "confidence"))
        assert reward.mean() == pytest.approx(record["reward"], rel=1e-6, abs=1e-6)
        assert correct.mean() == record["accuracy"]
        assert confidence.mean() == pytest.approx(record["confidence"], rel=1e-6, abs=1e-6)
        assert all(isinstance(s[0], str) and s[0] and isinstance(s[1], str) for s in samples)
        assert samples[0][0] == samples[1][0] and samples[2][0] == samples[3][0]  # whole groups of G = 2
    assert summary["config"] == dump_config(cfg) and summary["name"] == "run" and summary["project"] == "car-test"
    assert [step for step, _ in tb_texts(run_dir)["samples/text_summary"]] == [1, 2]


# --- config -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, loggers", [
    ([], ("tensorboard",)),
    (["run.loggers=[]"], ()),
    (["run.loggers=[wandb, tensorboard]"], ("wandb", "tensorboard")),
    (["run.tensorboard=false"], ()),  # the deprecated key, as configs/ and saved runs write it
    (["run.tensorboard=true"], ("tensorboard",)),
    (["run.tensorboard=false", "run.loggers=[wandb]"], ("wandb",)),  # both given, and they agree
    (["run.tensorboard=true", "run.loggers=[tensorboard, wandb]"], ("tensorboard", "wandb")),
])
def test_loggers_resolve_and_round_trip(overrides, loggers, tmp_path):
    cfg = load_config(TrainConfig, None, overrides)
    assert cfg.run.loggers == loggers and cfg.run.tensorboard is None
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(TrainConfig, tmp_path / "config.yaml") == cfg


def test_an_old_run_section_still_loads(tmp_path):
    """A saved config.yaml from before run.loggers (every run in results/ has one)."""
    path = tmp_path / "config.yaml"
    path.write_text("run:\n  dir: runs/x\n  checkpoint_every: 5\n  keep: 1\n  tensorboard: false\n  resume: true\n")
    assert load_config(TrainConfig, path).run.loggers == ()
    path.write_text(path.read_text().replace("tensorboard: false", "tensorboard: true"))
    assert load_config(TrainConfig, path).run.loggers == ("tensorboard",)


@pytest.mark.parametrize("overrides, message", [
    (["run.loggers=[tensorboard, wandbb]"],
     "run.loggers: 'wandbb' is not a logger; the loggers are: tensorboard, wandb (metrics.jsonl is always written)"),
    (["run.loggers=[mlflow]"], "run.loggers: 'mlflow' is not a logger; the loggers are: tensorboard, wandb"),
    (["run.loggers=wandb"], "run.loggers: expected tuple[str, ...], got str 'wandb'; write a YAML list"),
    (["run.loggers=[wandb, wandb]"], "run.loggers: ['wandb', 'wandb'] lists 'wandb' twice"),
    (["run.tensorboard=true", "run.loggers=[wandb]"],
     "run.tensorboard: true contradicts run.loggers=['wandb']; run.tensorboard is deprecated: drop it"),
    (["run.tensorboard=false", "run.loggers=[tensorboard, wandb]"],
     "run.tensorboard: false contradicts run.loggers=['tensorboard', 'wandb']"),
    (["run.tensorboard=true", "run.loggers=[]"], "run.tensorboard: true contradicts run.loggers=[]"),
    (["run.wandb.mode=onlin"], "run.wandb.mode: 'onlin' must be one of online, offline, disabled, or null for $WANDB_MODE"),
    (["run.wandb.project=' '"], "run.wandb.project: ' ' must be a non-empty name, or null for $WANDB_PROJECT"),
    (["run.wandb.projet=x"], "unknown key 'run.wandb.projet' in WandbConfig; did you mean 'run.wandb.project'?"),
    (["run.samples_per_step=-1"], "run.samples_per_step: -1 must be >= 0"),
])
def test_bad_logger_settings_fail_in_one_line_at_their_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_run_config_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match=r"'tb' is not a logger; the loggers are: tensorboard, wandb"):
        RunConfig(loggers=("tb",))
    assert RunConfig(loggers=["wandb"]).loggers == ("wandb",)
    with pytest.raises(ValueError, match=r"unknown logger 'tb'; the loggers are: tensorboard, wandb"):
        MetricsLogger("unused", loggers=("tb",))


# --- the optional dependency ----------------------------------------------------------------

def test_missing_wandb_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs the wandb package .*: pip install 'car_jax\[wandb\]'$"):
        import_wandb()
    with pytest.raises(ImportError, match=r"pip install 'car_jax\[wandb\]'"):
        MetricsLogger(tmp_path / "run", loggers=("tensorboard", "wandb"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the loggers open first
    with MetricsLogger(tmp_path / "plain", loggers=("tensorboard",)) as log:  # the others need no wandb
        log.log(1, {"reward": 1.0})
    # the trainer checks before anything loads: a data path that does not exist is not reached
    from car_jax.train.trainer import Trainer

    cfg = load_config(TrainConfig, None, [f"data.train={tmp_path / 'missing.jsonl'}", "run.loggers=[wandb]",
                                          f"run.dir={tmp_path / 'train'}"])
    with pytest.raises(ImportError, match=r"pip install 'car_jax\[wandb\]'"):
        Trainer(cfg)


def test_wandb_is_imported_only_when_chosen():
    code = ("import sys\nimport car_jax.train.trainer, car_jax.train.log, car_jax.train.loggers, car_jax.cli\n"
            "print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_online_without_a_key_says_how_to_log_in_or_go_offline(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(RuntimeError, match=r"W&B could not start a run: .*API key.*run\.wandb\.mode=offline"):
        MetricsLogger(tmp_path / "run", loggers=("wandb",), wandb=WandbConfig(mode="online"))
