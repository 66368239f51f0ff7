"""The cache's build-once folders (`build_once`): concurrent builders and interrupted builds."""
import threading

import pytest

from car_jax.checkpoints.embedded import build_once


def _writer(tag, barrier=None):
    def build(folder):
        (folder / "weights.bin").write_text(tag)
        if barrier is not None:
            barrier.wait(timeout=10)  # every builder has written before any publishes
        (folder / "config.json").write_text(tag)
    return build


def test_concurrent_builders_all_get_one_complete_folder(tmp_path):
    out, barrier, results, errors = tmp_path / "model", threading.Barrier(3), [], []

    def run(tag):
        try:
            results.append(build_once(out, _writer(tag, barrier)))
        except Exception as err:  # noqa: BLE001 - the assertion below reports it
            errors.append(err)

    threads = [threading.Thread(target=run, args=(f"builder-{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [out] * 3
    # one builder's folder, whole: its weights and its config come from the same build
    assert (out / "config.json").read_text() == (out / "weights.bin").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_interrupted_build_leaves_nothing_and_is_redone(tmp_path):
    out = tmp_path / "model"

    def broken(folder):
        (folder / "weights.bin").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(out, broken)
    assert list(tmp_path.iterdir()) == []
    assert build_once(out, _writer("whole")) == out
    assert (out / "config.json").read_text() == "whole"


def test_a_built_folder_is_not_rebuilt(tmp_path):
    out = tmp_path / "model"
    build_once(out, _writer("first"))
    build_once(out, _writer("second"))
    assert (out / "config.json").read_text() == "first"
