"""Where a configured model path points: a local checkpoint, a built-in model, or a Hugging
Face hub id, fetched into the standard HF cache.

`resolve_model_path` is the one function that turns `model.path` (train and eval configs,
and so the experiment, control and pilot runs built on them), `car-jax convert --src` and the
path given to `car_jax.load_model` / `car_jax.load_tokenizer` into a local file or folder:

    model.path=""                                # the embedded SmolLM2-135M-Instruct
    model.path=builtin:tiny-random               # the positive control's 2-layer random model
    model.path=runs/car/hf                       # HF folder, .gguf file or car_jax params folder
    model.path=Qwen/Qwen2.5-3B-Instruct          # a hub id: revision main, downloaded once
    model.path=Qwen/Qwen2.5-3B-Instruct@v1.0     # ... at a branch, tag or commit (`@REVISION`)

A path that exists locally always wins: `Qwen/Qwen2.5-3B-Instruct` is a hub id only where no
file or folder of that name exists (relative to the working directory). A hub id is
`owner/name` with the hub's characters (letters, digits, `_ . -`), optionally `@revision`
(the revision may hold `/`, as `refs/pr/1` does). Anything that is neither an existing path
nor a hub id nor a built-in name is a CheckpointError naming it.

A hub id is fetched with `huggingface_hub.snapshot_download` into the HF cache
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub; the layout the hub
uses: `models--owner--name/{refs,snapshots,blobs}`), and only what car_jax reads
(`HUB_FILES`: top-level safetensors, the JSON files, tokenizer vocabularies, chat template);
the result is the snapshot folder of the revision, an HF folder like any other. Online, the
revision is looked up each time (a moved branch is fetched) and files already cached are not
downloaded again. With `HF_HUB_OFFLINE=1` only the cache is read, and an id missing from it is
one error naming the id, the cache folder and the fix.

Several processes (`jax.distributed`): every process resolves the path itself, with no jax
collective (so it works before `jax.distributed.initialize` and with one process alike). The
download runs under an exclusive lock file in the cache, `<cache>/.locks/car_jax/
models--owner--name.lock` (`huggingface_hub.utils.WeakFileLock`, the hub's own cache lock:
`flock`, or a plain lock file where the filesystem has no `flock`): on a host, the first process
downloads while the others wait on the lock, then find every file cached and only look up the
revision. So each host (each cache folder) downloads once, and hosts sharing one cache folder
queue on the same lock. Offline nothing is written, so no lock is taken.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import WeakFileLock

from car_jax.checkpoints.embedded import TINY_RANDOM, default_model_dir, tiny_random_dir
from car_jax.checkpoints.safetensors_io import CheckpointError
from car_jax.checkpoints.sources import KINDS

BUILTINS = {TINY_RANDOM: tiny_random_dir}
# What car_jax reads from a model repo: weights, config / generation config / tokenizer /
# safetensors index (*.json), vocabularies (tokenizer.model, merges.txt, vocab.txt, *.tiktoken)
# and a chat template file. Top level only (`HUB_SKIP`): subfolders hold other formats
# (onnx/, original/), and `consolidated.safetensors` repeats the weights in Mistral's layout.
HUB_FILES = ["*.safetensors", "*.json", "tokenizer.model", "*.txt", "*.tiktoken", "*.jinja"]
HUB_SKIP = ["*/*", "consolidated*.safetensors"]
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"  # an owner or a name, as the hub allows
HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[A-Za-z0-9_.][A-Za-z0-9_./-]*))?")
HUB_FORM = "a hub id owner/name or owner/name@revision, such as Qwen/Qwen2.5-3B-Instruct"


def parse_hub_id(text: str) -> tuple[str, str] | None:
    """(repo id, revision) of `text` when it has the form of a hub id ("main" when no
    `@revision` is given), else None. Says nothing about whether the repo exists."""
    m = HUB_ID.fullmatch(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"] or len(m["repo"]) > 96:
        return None
    return m["repo"], m["revision"] or "main"


def is_hub_id(path: str | os.PathLike) -> bool:
    """Whether `resolve_model_path` fetches `path` from the hub: a string of the hub id form
    (not "" or a `builtin:` name) with no local file or folder of that name."""
    return (isinstance(path, str) and not path.startswith("builtin:") and parse_hub_id(path) is not None
            and not Path(path).exists())


def hub_cache_dir() -> Path:
    """The HF hub cache folder: `$HF_HUB_CACHE` as set now (so a test or a launcher may set it
    after `huggingface_hub` is imported), else the hub's own default."""
    return Path(os.environ.get("HF_HUB_CACHE") or hub_constants.HF_HUB_CACHE).expanduser()


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids network access: the variable as set now, else as it
    was when `huggingface_hub` was imported."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(hub_constants.HF_HUB_OFFLINE)
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_path(path: str | os.PathLike) -> Path:
    """The local file or folder a model path names (module docstring): "" and the
    `builtin:` names are built once in the car_jax cache, an existing path is returned as it
    is, a hub id is fetched (or, offline, found) in the HF cache and its snapshot folder
    returned. A `Path` (or other os.PathLike) is always taken as local. Raises CheckpointError
    naming `path` when it is none of these, or when the hub id cannot be had."""
    if not isinstance(path, str):
        return Path(path)
    if not path:
        return default_model_dir()
    if path.startswith("builtin:"):
        if path not in BUILTINS:
            raise CheckpointError(f"{path}: no such built-in model; the built-in ones are {', '.join(BUILTINS)} "
                                  "(and \"\" for the embedded SmolLM2-135M-Instruct)")
        return BUILTINS[path]()
    if is_hub_id(path):
        return hub_snapshot(*parse_hub_id(path))
    if not Path(path).exists():
        raise CheckpointError(f"{path}: no such file or folder, and not a hub id (owner/name[@revision]); "
                              f"give {KINDS}, or {HUB_FORM}")
    return Path(path)


def hub_snapshot(repo_id: str, revision: str = "main") -> Path:
    """The snapshot folder of `repo_id` at `revision` in the HF cache, downloading what is
    missing (`HUB_FILES`) unless offline; with several processes, under the cache's lock
    (module docstring). Raises CheckpointError naming the id, the cache and the fix."""
    cache = hub_cache_dir()
    shown = repo_id if revision == "main" else f"{repo_id}@{revision}"
    offline = hub_offline()
    fix = ("run once with internet access (HF_HUB_OFFLINE unset) to download it there, or give a local folder "
           "holding the model")
    try:
        if offline:
            folder = _download(repo_id, revision, cache, local_only=True)
        else:
            lock = lock_file(cache, repo_id)
            lock.parent.mkdir(parents=True, exist_ok=True)
            with WeakFileLock(lock):  # the host's processes download one at a time
                folder = _download(repo_id, revision, cache, local_only=False)
    except IncompleteSnapshotError:
        raise CheckpointError(f"{shown}: the Hugging Face cache {cache} holds an incomplete download of "
                              f"{repo_id} (revision {revision}); {fix}") from None
    except LocalEntryNotFoundError as err:
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline
               else f"the hub could not be reached: {str(err).splitlines()[0][:200]}")
        raise CheckpointError(f"{shown}: no such local file or folder, and hub id {repo_id} (revision {revision}) "
                              f"is not in the Hugging Face cache {cache} ({why}); {fix}") from None
    except GatedRepoError:
        raise CheckpointError(f"{shown}: the hub repo {repo_id} is gated; accept its terms on the hub and log in "
                              f"(`hf auth login`, or set HF_TOKEN), or give a local folder") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{shown}: the hub repo {repo_id} has no revision {revision!r}; after '@' give a "
                              f"branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{shown}: no such local file or folder, and no model repo {repo_id} on the hub "
                              f"(or it is private: log in with `hf auth login` or set HF_TOKEN); give {KINDS}, "
                              f"or {HUB_FORM}") from None
    except HfHubHTTPError as err:
        raise CheckpointError(f"{shown}: the hub answered {str(err).splitlines()[0][:200]}; try again, or give "
                              f"a local folder holding the model") from None
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{shown}: the hub snapshot {folder} holds no .safetensors weights (car_jax reads "
                              f"safetensors from the hub); convert the model yourself and give its folder or "
                              f".gguf file")
    return folder


def _download(repo_id: str, revision: str, cache: Path, *, local_only: bool) -> Path:
    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=local_only,
                                  allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))


def lock_file(cache: Path, repo_id: str) -> Path:
    """The lock file the processes of a host queue on to download `repo_id` into `cache`."""
    return cache / ".locks" / "car_jax" / ("models--" + repo_id.replace("/", "--") + ".lock")


