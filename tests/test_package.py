"""The package's shape: no import cycles, backend tests only in the execution policy, and
imports at the top of modules (function-local ones only in cli/, where start-up speed matters,
and for an optional extra's package)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "car_jax"
POLICY_MODULE = "car_jax.models.policy"  # the one place that asks which backend runs
# imported where used: a user-facing extra's package (tfds, wandb), and bm25s, whose import runs a
# JAX computation (it would start the backend before a multi-process run's jax.distributed.initialize)
EXTRA_MODULES = {"tensorflow_datasets", "wandb", "bm25s"}


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


def import_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file). `from pkg import x`
    counts as importing pkg.x when that is a module; importing a.b.c also runs a and a.b."""
    known = set(mods)
    top = next(iter(known)).split(".")[0]
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


def test_importing_the_package_leaves_the_backend_unstarted():
    """A multi-process run calls jax.distributed.initialize after importing car_jax (the CLI,
    or a user's script): no module may start the XLA backend when imported."""
    code = ("import jax._src.xla_bridge as xb, pkgutil, importlib, car_jax\n"
            "for m in pkgutil.walk_packages(car_jax.__path__, 'car_jax.'):\n"
            "    if not m.name.split('.')[-1].startswith('_'): importlib.import_module(m.name)\n"
            "print(sorted(xb._backends))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    not_in_all, unloaded, not_in_dir = out.stdout.strip().splitlines()
    assert not_in_all == "[]"
    assert "'load_model'" in unloaded  # lazy: not in the module's namespace yet ...
    assert not_in_dir == "[]"  # ... but dir() shows it
