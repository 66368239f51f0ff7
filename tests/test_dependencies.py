"""The base install carries every third-party package the package imports.

`make run` installs `.` alone (no test extras), so a module under car_jax/ that imports a
package only the test extras bring in (torch, sklearn, psutil, ...) breaks the README's
first command for every new user while the test suite, which installs the extras, passes.
"""
import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "car_jax"

# Packages a base dependency needs at run time but does not declare, on a path the main job
# takes: transformers' `apply_chat_template` imports jinja2 only when it is called.
RUNTIME_NEEDS = {"jinja2": "transformers' apply_chat_template (every chat prompt)"}
# User-facing extras: car_jax imports their packages only inside the functions that need them
# (tests/test_tfds.py checks that for tfds, tests/test_loggers.py for wandb), with an error naming the extra.
USER_EXTRAS = ("tfds", "wandb")


def _dist_name(requirement: str) -> str:
    """'orbax-checkpoint>=0.11' -> 'orbax-checkpoint' (normalised as PEP 503 does)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def base_dependencies(*extras: str) -> set[str]:
    """The base install's distributions, plus those of `extras`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = [r for name in extras for r in project["optional-dependencies"][name]]
    return {_dist_name(r) for r in project["dependencies"] + extra}


def third_party_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Top-level module name -> the files under `root` that import it (every import, also
    function-local ones), leaving out the standard library and car_jax itself."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "car_jax":
                    found.setdefault(top, set()).add(str(path.relative_to(root.parent)))
    return found


def undeclared(imports: dict[str, set[str]], declared: set[str]) -> list[str]:
    """One message per imported module that no declared distribution provides."""
    provides = md.packages_distributions()  # module name -> distributions installed here
    bad = []
    for module, files in sorted(imports.items()):
        dists = {_dist_name(d) for d in provides.get(module, [])}
        if not dists & declared:
            which = ", ".join(sorted(dists)) or "no installed distribution"
            bad.append(f"{module} ({which}) imported by {', '.join(sorted(files))}")
    return bad


def test_every_imported_package_is_a_base_dependency():
    bad = undeclared(third_party_imports(), base_dependencies(*USER_EXTRAS))
    assert not bad, ("car_jax imports packages the base install lacks; add them to [project] dependencies "
                     "in pyproject.toml or move the import to tests/benchmarks:\n  " + "\n  ".join(bad))


def test_runtime_needs_of_dependencies_are_declared():
    declared = base_dependencies()
    missing = {k: why for k, why in RUNTIME_NEEDS.items() if _dist_name(k) not in declared}
    assert not missing, f"base dependencies lack packages the main job needs at run time: {missing}"


def test_the_check_catches_a_test_only_import(tmp_path):
    # the check itself must fail on a module that imports a test extra (torch, sklearn)
    pkg = tmp_path / "car_jax"
    pkg.mkdir()
    (pkg / "ok.py").write_text("import numpy as np\nfrom jax import numpy as jnp\nimport os\n")
    (pkg / "bad.py").write_text("def f():\n    import sklearn.metrics\n    import torch\n")
    bad = undeclared(third_party_imports(pkg), base_dependencies())
    assert [b.split()[0] for b in bad] == ["sklearn", "torch"]
    assert all("car_jax/bad.py" in b for b in bad)
