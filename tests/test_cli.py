"""The CLI: its persistent XLA compilation cache, and config errors as one line (exit 2)."""
import os
import subprocess
import sys

import pytest

from car_jax.cli import main

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from car_jax.cli import enable_compilation_cache
print(enable_compilation_cache(min_seconds=0.0))
jax.jit(lambda x: jnp.tanh(x @ x.T))(jnp.ones((8, 8))).block_until_ready()
"""


def run(env_value):
    env = {**os.environ, "CAR_JAX_XLA_CACHE": env_value, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_compiled_programs_are_written_to_the_cache_folder(tmp_path):
    folder = tmp_path / "xla"
    assert run(str(folder)) == str(folder)
    assert any(folder.iterdir())  # the jitted program was stored


def test_the_cache_can_be_turned_off(tmp_path):
    assert run("off") == "None"


# ---------------------------------------------------------------- config errors
@pytest.fixture()
def no_model(monkeypatch):
    """Loading a model (or converting the embedded one) fails the test loudly."""
    import car_jax
    import car_jax.eval.job
    import car_jax.train.setup

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    for module, name in ((car_jax, "load_model"), (car_jax.train.setup, "load_policy"),
                         (car_jax.train.setup, "resolve_model_path"), (car_jax.eval.job, "load_eval_model")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("argv, key", [
    (["train", "rollout.group_size=0"], "rollout.group_size: 0 must be >= 2"),
    (["train", "rollout.group_size=1"], "rollout.group_size: 1 must be >= 2"),
    (["train", "rl.steps=-3"], "rl.steps: -3 must be >= 0"),
    (["train", "rl.optim.lr=0"], "rl.optim.lr: 0.0 must be > 0"),
    (["train", "rl.kl_cof=0.1"], "unknown key 'rl.kl_cof'"),
    (["train", "--config", "no/such.yaml"], "--config: config file 'no/such.yaml' does not exist"),
    (["eval", "batch_size=0"], "batch_size: 0 must be >= 1"),
    (["eval", "episode.top_p=2"], "episode.top_p: 2.0 must be in (0, 1]"),
])
def test_config_error_is_one_line_and_exit_2(argv, key, capsys, no_model):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"car-jax {argv[0]}: error: {key}") and out.err.count("\n") == 1, out.err
    assert "Traceback" not in out.err + out.out


def test_mesh_devices_beyond_the_machine_fail_before_the_model_loads(tmp_path, capsys, no_model):
    import jax

    n = jax.device_count()
    assert main(["train", f"mesh.devices={n + 1}", f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"car-jax train: error: mesh.devices: {n + 1} devices") and f"only {n} are" in err
    assert err.count("\n") == 1


def test_run_refuses_bad_counts_before_loading(capsys, no_model):
    with pytest.raises(SystemExit) as e:
        main(["run", "--rl-steps", "0"])
    assert e.value.code == 2 and "--rl-steps: 0 must be >= 1" in capsys.readouterr().err


def test_run_builds_its_configs_then_loads_the_model(tmp_path, capsys, monkeypatch, no_model):
    """`make run`'s job with its defaults: every config it builds loads (the embedded model is
    the default model.path, not an empty override), and only then does a model load."""
    import car_jax.checkpoints.embedded

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded after the configs were built")

    monkeypatch.setattr(car_jax.checkpoints.embedded, "default_model_dir", refuse)
    with pytest.raises(AssertionError, match="after the configs were built"):
        main(["run", "--out", str(tmp_path)])
    assert capsys.readouterr().err == ""


def test_run_closing_note_reads_its_own_numbers(tmp_path):
    """`car-jax run`'s closing note says what the run's evaluation shows: the most common
    stated confidence and its count (from samples.jsonl), the AUROCs of the summary."""
    import json

    from car_jax.cli.run import closing_note

    qs = [0.9, 0.9, 0.2, 0.9]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"confidence": q}) + "\n" for q in qs))
    note = closing_note({"accuracy": 0.5, "auroc": 0.5, "expected": {"auroc": 0.75}}, tmp_path, 2, 8)
    assert "After 2 GRPO steps on 8 trajectories the policy states 0.90 on 3 of 4 questions (accuracy 0.50)" in note
    assert "stated confidence is 0.50 and of its expected confidence at the tag 0.75" in note
    note = closing_note({"accuracy": 1.0, "auroc": float("nan")}, tmp_path, 2, 8)
    assert "stated confidence is undefined (one class)" in note and "tag undefined (one class)" in note


# ---------------------------------------------------------------- errors a new user meets
def one_line(capsys, command: str, message: str) -> str:
    """The one stderr line of a failed command, checked to start with `message`."""
    out = capsys.readouterr()
    assert out.err.startswith(f"car-jax {command}: error: {message}") and out.err.count("\n") == 1, out.err
    assert "Traceback" not in out.err + out.out
    return out.err


@pytest.mark.parametrize("argv, message", [
    (["train", "data.train_split=dve"], "data.train_split: world has splits 'train' and 'dev', not 'dve'"),
    (["train", "data.train=chance", "data.train_split=dve"], "data.train_split: chance has splits 'train', 'dev' and "
                                                            "'extremes', not 'dve'"),
    (["train", "data.train=/no/such.jsonl"], "data.train: dataset '/no/such.jsonl' not found"),
    (["train", "sft.steps=1", "sft.data=/no/demos.jsonl"], "sft.data: '/no/demos.jsonl' is not a file"),
    (["eval", "data.split=dve"], "data.split: world has splits 'train' and 'dev', not 'dve'"),
    (["eval", "data.path=world-large", "data.split=tset"], "data.split: world-large has splits 'train', 'dev', "),
    (["eval", "data.path=/no/such.jsonl"], "data.path: dataset '/no/such.jsonl' not found"),
])
def test_bad_data_is_one_line_before_the_model_loads(argv, message, tmp_path, capsys, no_model):
    out = "run.dir" if argv[0] == "train" else "output.dir"
    assert main([*argv, f"{out}={tmp_path / 'out'}"]) == 2
    one_line(capsys, argv[0], message)


def test_train_check_loads_and_checks_the_config_only(capsys, no_model):
    argv = ["train", "--check", "--config", "configs/tiny_test.yaml", "rl.steps=3", "data.train=/only/on/the/vm.jsonl"]
    assert main(argv) == 0  # the data file is the run machine's business: not checked here
    out = capsys.readouterr()
    assert out.err == "" and out.out.count("\n") == 1
    assert out.out.startswith("car-jax train: config ok (configs/tiny_test.yaml, 2 override(s))"), out.out
    assert "3 GRPO steps -> runs/tiny_test" in out.out
    assert main(["train", "--check", "rl.kl_cof=0.1"]) == 2
    one_line(capsys, "train", "unknown key 'rl.kl_cof'")
    assert main(["train", "--check", "data.train_split=dve"]) == 2
    one_line(capsys, "train", "data.train_split: world has splits")


def test_convert_of_a_missing_source_is_one_line(tmp_path, capsys):
    assert main(["convert", "--src", str(tmp_path / "nope.gguf"), "--dst", str(tmp_path / "out")]) == 2
    one_line(capsys, "convert", f"--src: {tmp_path / 'nope.gguf'}: no such file or folder, and not a hub id")
    assert not (tmp_path / "out").exists()


def test_eval_folder_with_samples_names_output_resume(tmp_path, capsys, no_model):
    from car_jax.data import load_dataset
    from car_jax.eval.runner import EvalOptions, evaluate

    (tmp_path / "samples.jsonl").write_text('{"id": "x"}\n')
    assert main(["eval", f"output.dir={tmp_path}"]) == 2
    err = one_line(capsys, "eval", f"output.dir: {tmp_path / 'samples.jsonl'} already holds samples; "
                                   "pass output.resume=true")
    assert "--resume" not in err
    with pytest.raises(FileExistsError) as e:  # the library's own check says the key too
        evaluate(None, None, load_dataset("world", limit=1), EvalOptions(mode="direct"), out_dir=tmp_path)
    assert "output.resume=true" in str(e.value) and "--resume" not in str(e.value)


@pytest.fixture()
def no_loading(monkeypatch):
    """Loading a model or a tokenizer fails the test loudly."""
    import car_jax

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the path was checked")

    monkeypatch.setattr(car_jax, "load_model", refuse)
    monkeypatch.setattr(car_jax, "load_tokenizer", refuse)


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("files, missing", [
    ({}, "no config.json and no weights (model.safetensors, model.safetensors.index.json, car_jax_params.json)"),
    ({"config.json": "{}", "tokenizer.json": "{}"}, "no weights (model.safetensors, model.safetensors.index.json, "
                                                    "car_jax_params.json)"),
])
def test_a_folder_without_a_model_says_so(command, files, missing, tmp_path, capsys, no_loading):
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    out = "run.dir" if command == "train" else "output.dir"
    assert main([command, f"model.path={folder}", f"{out}={tmp_path / 'out'}"]) == 2
    err = one_line(capsys, command, f"model.path: {folder} holds no model: {missing}; give an HF folder")
    assert "tokenizer" not in err


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == version("car_jax")


def test_every_run_option_has_help_text():
    import argparse

    from car_jax.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [a for a in sub.choices["run"]._actions if a.option_strings and a.dest != "help"]
    assert {"--prompt", "--out", "--eval-questions", "--sft-steps", "--rl-steps", "--control"} <= {
        s for a in options for s in a.option_strings}
    assert [a.option_strings[0] for a in options if not a.help or a.help == argparse.SUPPRESS] == []
