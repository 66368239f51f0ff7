"""car_jax.train.log: JSONL metrics, TensorBoard scalars, progress bar, phase timer."""
from __future__ import annotations

import json
import math
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.train.log import METRICS_FILE, MetricsLogger, Progress, Timer, read_metrics


def _tb_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Parses tensorboardX event files (TFRecord framing) into tag -> [(step, value)]."""
    from tensorboardX.proto import event_pb2

    files = sorted((run_dir / "tb").glob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file written"
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        data = f.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4  # length, length crc, payload, payload crc
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_jsonl_round_trip_and_tensorboard(tmp_path):
    t0 = time.time()
    with MetricsLogger(tmp_path, progress=Progress(3)) as log:
        log.log(1, {"reward": 0.5, "kl": np.float32(0.25), "n": 3,
                    "acc": jnp.asarray(0.75), "flag": True})
        log.log(2, {"reward": float("nan"), "kl": float("inf"), "ece": -math.inf})
        log.log(3, {"reward": jnp.ones((1,))})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 3
    raw = [json.loads(ln) for ln in lines]  # strict JSON: NaN/inf are strings
    assert raw[1]["reward"] == "NaN" and raw[1]["kl"] == "Infinity"
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["reward"] == 0.5 and recs[0]["kl"] == 0.25 and recs[0]["acc"] == 0.75
    assert recs[0]["n"] == 3 and isinstance(recs[0]["n"], int) and recs[0]["flag"] == 1
    assert t0 <= recs[0]["time"] <= time.time()
    assert math.isnan(recs[1]["reward"]) and recs[1]["kl"] == math.inf
    assert recs[1]["ece"] == -math.inf
    tb = _tb_scalars(tmp_path)
    # non-finite values stay in the JSONL but are not sent to TensorBoard
    assert tb["reward"] == [(1, 0.5), (3, 1.0)]
    assert tb["kl"] == [(1, 0.25)] and "ece" not in tb
    assert tb["n"] == [(1, 3.0)]


def test_lines_are_flushed_before_close(tmp_path):
    log = MetricsLogger(tmp_path, loggers=())
    log.log(7, {"loss": 1.0})
    assert read_metrics(tmp_path) == [{"step": 7, "time": pytest.approx(time.time(), abs=60),
                                       "loss": 1.0}]
    log.close()
    log.close()  # idempotent


def test_resume_appends_and_repairs_truncated_line(tmp_path):
    with MetricsLogger(tmp_path, loggers=()) as log:
        for s in range(1, 5):
            log.log(s, {"loss": float(s)})
    path = tmp_path / METRICS_FILE
    with open(path, "a") as f:
        f.write('{"step": 5, "loss": 5')  # crash mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    # resume from a checkpoint at step 2: lines 3, 4 and the partial line go away
    with pytest.warns(UserWarning, match="partial last line"):
        log = MetricsLogger(tmp_path, loggers=(), truncate_after=2)
    with log:
        log.log(3, {"loss": 30.0})
    recs = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    # plain resume keeps everything and appends
    with MetricsLogger(tmp_path, loggers=()) as log:
        log.log(4, {"loss": 40.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_bad_lines_and_values(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "missing")
    with MetricsLogger(tmp_path / "r", loggers=()) as log:
        with pytest.raises(ValueError, match=r"'loss' has shape \(3,\)"):
            log.log(1, {"loss": np.zeros(3)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            log.log(1, {"step": 1})
        with pytest.raises(ValueError, match="'name' = 'abc'"):
            log.log(1, {"name": "abc"})


def test_progress_bar_tracks_steps(tmp_path):
    with MetricsLogger(tmp_path, loggers=(), progress=Progress(10, initial_step=4, show=("reward", "missing"))) as log:
        log.log(5, {"reward": 0.123456, "kl": 1.0})
        log.log(7, {"reward": 0.5})
        bar = log._bar
        assert bar.n == 7 and bar.total == 10 and bar.initial == 4
        assert bar.postfix == "reward=0.5"


def test_timer_accumulates_and_resets(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.5, 4.0, 10.0, 10.0, 12.0, 12.5, 20.0, 25.0])
    monkeypatch.setattr("car_jax.train.log.time.perf_counter", lambda: next(clock))
    timer = Timer()  # start at 0
    with timer("rollout"):  # 1 -> 3
        pass
    with timer("rollout"):  # 3.5 -> 4
        pass
    with timer("update"):  # 10 -> 10
        pass
    assert timer.split() == {"time/rollout": 2.5, "time/update": 0.0, "time/step": 12.0}
    with timer("reward"):  # 12.5 -> 20
        pass
    assert timer.split() == {"time/reward": 7.5, "time/step": 13.0}
    with pytest.raises(ValueError, match="reserved"):
        with timer("step"):
            pass


def test_timer_counts_time_when_the_block_raises():
    timer = Timer(prefix="t/")
    with pytest.raises(RuntimeError):
        with timer("tools"):
            raise RuntimeError("tool failed")
    split = timer.split()
    assert set(split) == {"t/tools", "t/step"} and split["t/tools"] >= 0.0
