"""`car-jax plan --config X.yaml [--mesh fsdp=F,tp=T] [--chip v5p] [--json] [--xla] [key=value ...]`:
per-device memory of a training config against a chip's HBM, and its FLOPs per step, without
weights (`car_jax.plan`). The mesh defaults to the config's own (-1 needs --mesh or
mesh.devices), the chip to the one the config's file name names (`..._h100-8.yaml`), else
v5p, with one line on stderr saying which; --xla also compiles the real train step and
rollout programs from abstract inputs and prints XLA's `memory_analysis()` beside the plan
(a fake CPU mesh needs XLA_FLAGS=--xla_force_host_platform_device_count=N).
`car-jax plan --table configs/fit` prints the markdown table of a folder of configs sized to
fit their chips (`plan.fit`; docs/PLAN.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from car_jax.cli import add_config_args, load_config_args
from car_jax.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory and FLOPs of a training config on a chip, without weights")
    add_config_args(p, "a `car-jax train` config", "rl.micro_batch=32 model.remat=false")
    p.add_argument("--mesh", default=None, help="fsdp=F,tp=T (default: the config's mesh section)")
    p.add_argument("--chip", default=None, help="v5e, v5p, v6e, h100, h200 (the chip table of car_jax.train.flops); "
                   "default: the chip the config's file name names (..._h100-8.yaml), else v5p, said on stderr")
    p.add_argument("--prompt-tokens", type=int, default=None, help="the longest prompt, in tokens (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--xla", action="store_true", help="also compile the programs and print XLA's memory_analysis")
    p.add_argument("--table", default=None, metavar="DIR",
                   help="print the markdown table of every <model>_<chip>-<n>.yaml in DIR, each on its own mesh and "
                        "chip (docs/PLAN.md: --table configs/fit)")
    p.set_defaults(func=plan_command)


def plan_command(args) -> int:
    from car_jax.plan import config_mesh, format_table, make_plan, max_rollout_rows, model_config, parse_mesh
    from car_jax.plan.plan import PROMPT_TOKENS
    from car_jax.train.config import TrainConfig

    if args.table:
        from car_jax.assets import resolve_config
        from car_jax.plan.fit import fit_document
        try:  # --table configs/fit outside a clone: the shipped folder
            print(fit_document(resolve_config(args.table), args.prompt_tokens or PROMPT_TOKENS), end="")
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from None
        return 0
    cfg = load_config_args(TrainConfig, args)
    chip = args.chip or _chip_of(args.config)
    try:
        fsdp, tp = parse_mesh(args.mesh) if args.mesh else config_mesh(cfg)
        model = model_config(cfg.model.path)
        plan = make_plan(cfg, fsdp, tp, chip, args.prompt_tokens or PROMPT_TOKENS, model=model)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    rows = max_rollout_rows(cfg, plan, model)
    xla = None
    if args.xla:
        from car_jax.plan.xla import fake_mesh, xla_memory
        out = xla_memory(cfg, model, fake_mesh(fsdp, tp), plan.shapes)
        xla = {k: {"argument": v.argument, "output": v.output, "alias": v.alias, "temp": v.temp, "peak": v.peak}
               for k, v in out.items()}
    if args.json:
        print(json.dumps({**plan.to_json(), "max_rollout_rows": rows, **({"xla": xla} if xla else {})}))
        return 0
    print(format_table(plan, rows))
    for name, m in (xla or {}).items():
        print(f"xla {name}: peak {m['peak'] / 2**30:.2f} GiB (argument {m['argument'] / 2**30:.2f}, "
              f"temp {m['temp'] / 2**30:.2f}, output {m['output'] / 2**30:.2f}, aliased {m['alias'] / 2**30:.2f})")
    return 0


def _chip_of(config: str | None) -> str:
    """The chip to plan for without --chip: the one the config's file name names
    (`plan.fit.chip_in_name`), else DEFAULT_CHIP; one line on stderr says which and why."""
    from car_jax.plan.fit import chip_in_name
    from car_jax.plan.plan import DEFAULT_CHIP
    from car_jax.train.flops import CHIPS

    found = chip_in_name(config) if config else None
    if found:
        print(f"car-jax plan: chip {found}, named by the config's file name {Path(config).name} (--chip overrides)",
              file=sys.stderr)
        return found
    names = ", ".join(sorted({c.name for c in CHIPS.values()}))
    print(f"car-jax plan: no --chip given and {'no config' if not config else 'the config file name names no chip'}: "
          f"assuming {DEFAULT_CHIP} (--chip picks one of {names})", file=sys.stderr)
    return DEFAULT_CHIP
