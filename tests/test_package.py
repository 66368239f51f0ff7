"""The package's shape: no import cycles, packages layered one way (LAYERS), backend tests
only in the execution policy, and imports at the top of modules (function-local ones only in
cli/, where start-up speed matters, and for an optional extra's package)."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "car_jax"
POLICY_MODULE = "car_jax.models.policy"  # the one place that asks which backend runs
# imported where used: a user-facing extra's package (tfds, wandb), and bm25s, whose import runs a
# JAX computation (it would start the backend before a multi-process run's jax.distributed.initialize)
EXTRA_MODULES = {"tensorflow_datasets", "wandb", "bm25s"}
# car_jax's packages (a subpackage, or a module at the top) from the bottom up: each imports only
# those before it, so none imports its way back. README.md's "Layout" lists them in this order.
LAYERS = ("config", "dims", "params", "hosts", "assets", "sharding", "calibration", "models", "checkpoints",
          "loading", "tools", "data", "rollout", "rl", "eval", "train", "plan", "experiment", "cli")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    return {module_name(p, root): ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` (a module, or module.attribute) lies in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def lazy_exports(root: ast.Module) -> dict[str, str]:
    """The top package's lazy exports (`_EXPORTS`: public name -> (module, attribute)), as
    name -> module; {} without them."""
    for node in root.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return {name: module for name, (module, _) in ast.literal_eval(node.value).items()}
    return {}


def import_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file). `from pkg import x`
    counts as importing pkg.x when that is a module; importing a.b.c also runs a and a.b.
    The top package's lazy exports count as their modules: `from car_jax import load_model`
    imports car_jax.loading, and a plain `import car_jax` every exported module."""
    known = set(mods)
    top = next(iter(known)).split(".")[0]
    exports = lazy_exports(mods[top]) if top in mods else {}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, tree in mods.items():
        is_pkg = any(k.startswith(mod + ".") for k in known)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t.split(".")[0] != top:
                    continue
                if t == top or t.removeprefix(top + ".") in exports:
                    graph[mod] |= {e for name, e in exports.items() if t in (top, f"{top}.{name}")} - {mod}
                hit = _resolve(t, known)
                while hit:
                    if hit != mod and not mod.startswith(hit + "."):
                        graph[mod].add(hit)
                    hit = hit.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def package_of(module: str) -> str | None:
    """car_jax.models.decoder -> "models", car_jax.sharding -> "sharding"; the top package
    itself belongs to none."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layering_errors(graph: dict[str, set[str]], layers: Sequence[str]) -> list[str]:
    """What a module import graph breaks of `layers` (the packages from the bottom up): a
    package missing from the list or listed but absent, a cycle between packages, and every
    import of a package at or above the importer's, with the modules that make it."""
    packages: dict[str, set[str]] = {}
    upward: list[str] = []
    rank = {p: i for i, p in enumerate(layers)}
    for mod, deps in sorted(graph.items()):
        src = package_of(mod)
        if src is None:
            continue
        packages.setdefault(src, set())
        for dep in sorted(deps):
            dst = package_of(dep)
            if dst is None or dst == src:
                continue
            packages[src].add(dst)
            packages.setdefault(dst, set())
            if src in rank and dst in rank and rank[dst] > rank[src]:
                upward.append(f"{mod} imports {dep}: {dst} is above {src}")
    errors = [f"package {p} is not in the layers" for p in sorted(set(packages) - set(rank))]
    errors += [f"layer {p} is no package" for p in layers if p not in packages]
    if cycle := find_cycle(packages):
        errors.append("package cycle: " + " -> ".join(cycle))
    return errors + upward


def readme_layers(text: str) -> tuple[str, ...]:
    """The numbered list of packages in README.md's "Layout" section, "1. `config.py`" ...
    "7. `models/`" ... -> ("config", ..., "models", ...)."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return tuple(re.findall(r"^\d+\. `(\w+)(?:/|\.py)`", section, re.M))


def test_packages_layer_one_way():
    errors = layering_errors(import_graph(modules()), LAYERS)
    assert not errors, "\n".join(errors)


def test_the_readme_lists_the_layers():
    assert readme_layers((ROOT / "README.md").read_text()) == LAYERS


def test_the_layering_check_rejects_a_package_cycle():
    """Today's layers with the cycles and the sideways import the packages had before they
    were layered (issue 35): models.api loading checkpoints, which read models' config;
    calibration.sim on rl.grpo, which rl's batches answered with calibration.rewards; eval
    taking MeshConfig from train.config."""
    ok = {"car_jax.models.decoder": {"car_jax.models.config"}, "car_jax.models.config": set(),
          "car_jax.checkpoints.loader": {"car_jax.models.config"},
          "car_jax.rl.batches": {"car_jax.calibration.rewards"}, "car_jax.calibration.rewards": set(),
          "car_jax.eval.config": {"car_jax.sharding"}, "car_jax.train.config": {"car_jax.sharding"},
          "car_jax.sharding": set()}
    layers = ("sharding", "calibration", "models", "checkpoints", "rl", "eval", "train")
    assert layering_errors(ok, layers) == []
    old = {**ok, "car_jax.models.api": {"car_jax.checkpoints.loader", "car_jax.models.decoder"}}
    assert layering_errors(old, layers) == [
        "package cycle: checkpoints -> models -> checkpoints",
        "car_jax.models.api imports car_jax.checkpoints.loader: checkpoints is above models"]
    old = {**ok, "car_jax.calibration.sim": {"car_jax.rl.grpo"}, "car_jax.rl.grpo": set(),
           "car_jax.eval.config": {"car_jax.train.config"}}
    assert layering_errors(old, layers) == [
        "package cycle: calibration -> rl -> calibration",
        "car_jax.calibration.sim imports car_jax.rl.grpo: rl is above calibration",
        "car_jax.eval.config imports car_jax.train.config: train is above eval"]
    # a package the list leaves out, and a listed one the graph lacks
    assert layering_errors(ok, layers[1:] + ("plan",)) == ["package sharding is not in the layers",
                                                         "layer plan is no package"]


def test_the_layering_check_reads_lazy_exports_and_local_imports(tmp_path):
    """`import pkg` reaches the top package's lazy exports; a function-local import counts."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('_EXPORTS = {"thing": ("pkg.high.m", "thing")}\n')
    (pkg / "high" / "m.py").write_text("thing = 1\n")
    (pkg / "low" / "m.py").write_text("import pkg\n")
    graph = import_graph(modules(pkg))
    assert graph["pkg.low.m"] == {"pkg.high.m"}
    assert layering_errors(graph, ("low", "high")) == ["pkg.low.m imports pkg.high.m: high is above low"]
    (pkg / "low" / "m.py").write_text("def f():\n    from ..high.m import thing\n")
    assert layering_errors(import_graph(modules(pkg)), ("low", "high")) == [
        "pkg.low.m imports pkg.high: high is above low", "pkg.low.m imports pkg.high.m: high is above low"]
    (pkg / "low" / "m.py").write_text("x = 1\n")
    assert layering_errors(import_graph(modules(pkg)), ("low", "high")) == []


def test_no_import_cycles():
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_hidden_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # function-local, relative
    (pkg / "c.py").write_text("import os\nfrom pkg import a\n")
    assert find_cycle(import_graph(modules(pkg))) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(modules(pkg))) is None


def test_backend_tests_live_in_the_policy_module_only():
    found = [(name, node.lineno) for name, tree in modules().items() for node in ast.walk(tree)
             if isinstance(node, (ast.Attribute, ast.Name))
             and getattr(node, "attr", getattr(node, "id", None)) in ("default_backend", "platform")
             and name != POLICY_MODULE and _is_backend_query(node)]
    assert not found, f"backend tests outside {POLICY_MODULE}: {found}"


def _is_backend_query(node) -> bool:
    """jax.default_backend(), or a device's .platform."""
    if isinstance(node, ast.Attribute) and node.attr == "default_backend":
        return True
    if isinstance(node, ast.Name) and node.id == "default_backend":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "platform"


def python_output(code: str, timeout: int) -> str:
    """The stripped stdout of `code` run by a fresh interpreter on the CPU backend (it must exit 0)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_importing_the_package_leaves_the_backend_unstarted():
    """A multi-process run calls jax.distributed.initialize after importing car_jax (the CLI,
    or a user's script): no module may start the XLA backend when imported."""
    code = ("import jax._src.xla_bridge as xb, pkgutil, importlib, car_jax\n"
            "for m in pkgutil.walk_packages(car_jax.__path__, 'car_jax.'):\n"
            "    if not m.name.split('.')[-1].startswith('_'): importlib.import_module(m.name)\n"
            "print(sorted(xb._backends))")
    assert python_output(code, timeout=300) == "[]"


def test_imports_sit_at_the_top_outside_cli():
    local = []
    for name, tree in modules().items():
        if name.startswith("car_jax.cli"):
            continue
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if not all(n.split(".")[0] in EXTRA_MODULES for n in names):
                    local.append(f"{name}:{node.lineno}")
    assert not local, f"function-local imports outside car_jax/cli/: {local}"


def test_dir_lists_the_lazy_exports_before_they_load():
    """`dir(car_jax)` (and tab completion) shows the public names that `__getattr__` loads on
    first use; `__all__` lists every one of them."""
    code = ("import car_jax\n"
            "print(sorted(set(car_jax._EXPORTS) - set(car_jax.__all__)))\n"
            "print(sorted(set(car_jax.__all__) - set(vars(car_jax))))\n"
            "print(sorted(set(car_jax.__all__) - set(dir(car_jax))))")
    not_in_all, unloaded, not_in_dir = python_output(code, timeout=120).splitlines()
    assert not_in_all == "[]"
    assert "'load_model'" in unloaded  # lazy: not in the module's namespace yet ...
    assert not_in_dir == "[]"  # ... but dir() shows it
