"""Hub ids as model paths (`car_jax.checkpoints.hub`), against a Hugging Face cache laid out as
the hub lays it (models--owner--name/{refs,snapshots,blobs}) in a temp folder: nothing is
downloaded, HF_HUB_OFFLINE=1 except where `snapshot_download` itself is replaced by a fake."""
from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import car_jax
from car_jax.checkpoints import hub
from car_jax.checkpoints.safetensors_io import CheckpointError
from tests.hf_factory import build

REPO = "owner/tiny"
COMMIT_A = hashlib.sha1(b"a").hexdigest()
COMMIT_B = hashlib.sha1(b"b").hexdigest()
TOKENS = np.array([[1, 5, 9, 33, 70, 2], [4, 4, 95, 0, 17, 3]], np.int32)


def tiny_checkpoint(folder: Path, seed: int) -> Path:
    """A random tiny llama (vocab 96) saved by transformers, with a word-level tokenizer
    ("<unk>" 0, "<eos>" 1, "w2" .. "w95") beside it."""
    build("llama", folder, seed=seed)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 96)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    return folder


def put_in_cache(cache: Path, repo_id: str, folder: Path, commit: str, refs=("main",)) -> Path:
    """Files of `folder` as the hub cache holds a snapshot: content in blobs/<sha256>,
    snapshots/<commit>/<name> a relative symlink to its blob, refs/<ref> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny checkpoints (seeds 0 and 1) as plain HF folders."""
    root = tmp_path_factory.mktemp("hub_models")
    return tiny_checkpoint(root / "a", seed=0), tiny_checkpoint(root / "b", seed=1)


@pytest.fixture()
def cache(tmp_path, monkeypatch, checkpoints):
    """HF_HUB_CACHE with owner/tiny: main -> commit A (seed 0), tag v1 -> commit B (seed 1);
    offline; the working directory an empty folder (so no local path shadows the id)."""
    a, b = checkpoints
    root = tmp_path / "hf_cache"
    put_in_cache(root, REPO, a, COMMIT_A, refs=("main",))
    put_in_cache(root, REPO, b, COMMIT_B, refs=("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return root


def logits(path) -> np.ndarray:
    return np.asarray(car_jax.load_model(path, progress=False).logits(TOKENS))


def test_hub_id_loads_the_same_model_as_its_folder(cache, checkpoints):
    a, b = checkpoints
    model = car_jax.load_model(REPO, progress=False)
    assert model.source == cache / "models--owner--tiny" / "snapshots" / COMMIT_A
    np.testing.assert_array_equal(np.asarray(model.logits(TOKENS)), logits(str(a)))
    assert not np.allclose(logits(str(a)), logits(str(b)))  # the two checkpoints tell revisions apart
    tok = car_jax.load_tokenizer(REPO)
    assert tok("w5 w7 w95")["input_ids"] == car_jax.load_tokenizer(a)("w5 w7 w95")["input_ids"] == [5, 7, 95]
    assert tok.padding_side == "left" and tok.pad_token == "<eos>"


@pytest.mark.parametrize("spec, which", [(f"{REPO}@v1", 1), (f"{REPO}@{COMMIT_B}", 1), (f"{REPO}@main", 0),
                                         (f"{REPO}@{COMMIT_A}", 0)])
def test_a_revision_resolves(cache, checkpoints, spec, which):
    commit = (COMMIT_A, COMMIT_B)[which]
    assert hub.resolve_model_path(spec) == cache / "models--owner--tiny" / "snapshots" / commit
    np.testing.assert_array_equal(logits(spec), logits(str(checkpoints[which])))


def test_an_id_missing_from_the_cache_is_one_clear_error(cache):
    with pytest.raises(CheckpointError) as e:
        car_jax.load_model("owner/absent")
    msg = str(e.value)
    assert msg.startswith("owner/absent: no such local file or folder, and hub id owner/absent (revision main) is "
                          f"not in the Hugging Face cache {cache} (HF_HUB_OFFLINE=1 forbids downloading it)")
    assert "run once with internet access" in msg and "give a local folder" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match=r"^owner/tiny@nope: .*hub id owner/tiny \(revision nope\) is not in"):
        car_jax.load_tokenizer(f"{REPO}@nope")  # a revision the cache does not hold


def test_entry_points_resolve_hub_ids_and_name_the_key(cache, checkpoints, tmp_path):
    from car_jax.cli import main
    from car_jax.config import ConfigError
    from car_jax.eval.config import EvalModelConfig
    from car_jax.eval.job import EvalSetupError, load_eval_model
    from car_jax.train.config import PolicyConfig
    from car_jax.train.setup import load_policy

    snapshot = cache / "models--owner--tiny" / "snapshots" / COMMIT_B
    model, tok = load_policy(PolicyConfig(path=f"{REPO}@v1"), None)
    assert model.source == snapshot and tok("w9")["input_ids"] == [9]
    model, tok, path = load_eval_model(EvalModelConfig(path=f"{REPO}@v1", tokenizer=REPO))
    assert path == snapshot and model.source == snapshot
    np.testing.assert_array_equal(np.asarray(model.logits(TOKENS)), logits(str(checkpoints[1])))
    with pytest.raises(ConfigError, match=r"^model\.path=owner/absent: no such local file"):
        load_policy(PolicyConfig(path="owner/absent"), None)
    with pytest.raises(EvalSetupError, match=r"^model\.path=owner/absent: no such local file"):
        load_eval_model(EvalModelConfig(path="owner/absent"))
    with pytest.raises(EvalSetupError, match=r"^model\.tokenizer=owner/absent: no such local file"):
        load_eval_model(EvalModelConfig(path=REPO, tokenizer="owner/absent"))
    assert main(["convert", "--src", f"{REPO}@v1", "--dst", str(tmp_path / "params")]) == 0
    np.testing.assert_array_equal(logits(tmp_path / "params"), logits(str(checkpoints[1])))


def test_a_local_path_wins_over_the_hub_id(cache, checkpoints):
    local = Path("owner") / "tiny"  # relative to the working directory, as a config would give it
    local.parent.mkdir()
    os.symlink(checkpoints[1], local)
    assert hub.resolve_model_path(REPO) == local and not hub.is_hub_id(REPO)
    np.testing.assert_array_equal(logits(REPO), logits(str(checkpoints[1])))


@pytest.mark.parametrize("text, parsed", [
    ("Qwen/Qwen2.5-3B-Instruct", ("Qwen/Qwen2.5-3B-Instruct", "main")),
    ("Qwen/Qwen2.5-3B-Instruct@v1.0", ("Qwen/Qwen2.5-3B-Instruct", "v1.0")),
    ("org_1/model.x@refs/pr/1", ("org_1/model.x", "refs/pr/1")),
    (f"a/b@{COMMIT_A}", ("a/b", COMMIT_A)),
    ("Qwen2.5-3B-Instruct", None), ("a/b/c", None), ("/abs/x", None), ("./x/y", None), ("a//b", None),
    ("a--b/c", None), ("a/b.", None), ("a/b..c", None), ("a/b@", None), ("a/b c", None), ("a/b@x y", None),
])
def test_hub_id_form(text, parsed):
    assert hub.parse_hub_id(text) == parsed


@pytest.mark.parametrize("text, message", [
    ("no/such/folder", "no/such/folder: no such file or folder, and not a hub id (owner/name[@revision]); give "),
    ("not an id", "not an id: no such file or folder, and not a hub id"),
    ("builtin:nope", "builtin:nope: no such built-in model; the built-in ones are builtin:tiny-random"),
])
def test_neither_a_path_nor_a_hub_id_is_named(cache, text, message):
    with pytest.raises(CheckpointError) as e:
        hub.resolve_model_path(text)
    assert str(e.value).startswith(message), str(e.value)


def test_a_snapshot_without_safetensors_is_said_so(cache, tmp_path):
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text("{}")
    put_in_cache(cache, "owner/bin-only", weightless, COMMIT_A)
    with pytest.raises(CheckpointError, match=r"^owner/bin-only: the hub snapshot .* holds no \.safetensors"):
        hub.resolve_model_path("owner/bin-only")


def test_online_processes_of_a_host_download_one_at_a_time(cache, monkeypatch):
    """Online (a fake `snapshot_download`, so still no network): only what car_jax reads is
    asked for, into the configured cache, under the host's lock, one process (here: thread,
    each with its own lock descriptor, as flock sees processes) at a time."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls, inside, overlap = [], [], []
    lock = hub.lock_file(cache, REPO)

    def fake_snapshot_download(repo_id, **kwargs):
        inside.append(1)
        overlap.append(len(inside))
        probe = os.open(lock, os.O_RDWR)
        try:  # the lock is held while the download runs
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        time.sleep(0.05)
        calls.append((repo_id, kwargs))
        inside.pop()
        return str(cache / "models--owner--tiny" / "snapshots" / COMMIT_A)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    threads = [threading.Thread(target=hub.resolve_model_path, args=(REPO,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 3 and max(overlap) == 1
    repo_id, kwargs = calls[0]
    assert repo_id == REPO and kwargs["revision"] == "main" and kwargs["local_files_only"] is False
    assert Path(kwargs["cache_dir"]) == cache
    assert {"*.safetensors", "*.json", "tokenizer.model", "*.txt", "*.jinja"} <= set(kwargs["allow_patterns"])
    assert "*/*" in kwargs["ignore_patterns"]
    fcntl.flock(fd := os.open(lock, os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released afterwards
    os.close(fd)
