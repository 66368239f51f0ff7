"""The experiment as a list of units, each a plain `car-jax train` or `car-jax eval` run in
its own folder, run in order and skipped when already complete:

    <dir>/warm/                   SFT warm start (rl.steps = 0) on demonstrations written to
                                  warm/demos.jsonl; its policy is warm/hf
    <dir>/runs/<arm>-s<seed>/     GRPO from warm/hf with the arm's reward and the seed
    <dir>/evals/<policy>/<split>/ the policy (warm, or a run) evaluated greedily on a split
    <dir>/equivalence/{mscr,weighted_brier}/  the two runs of the equivalence check
    <dir>/progress.jsonl          one line per finished unit: name, seconds, time

The order: the warm start and its evaluations, then seed by seed every arm's run, each
followed by its evaluations, then the equivalence runs.

A unit stopped half way (a kill, a crash, the end of a sitting) resumes where it stopped:
training from its latest checkpoint (`run.resume`), evaluation from its samples file
(`output.resume`). So `car-jax experiment` can be run again and again until every unit is
done, in as many sittings as it takes.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path
from typing import Callable

from car_jax.calibration.rewards import RewardConfig
from car_jax.data import load_dataset
from car_jax.eval.config import EvalConfig, EvalModelConfig, OutputConfig
from car_jax.eval.job import run_eval
from car_jax.experiment.config import ExperimentConfig
from car_jax.rollout.toolbox import open_tools
from car_jax.train.config import SFTConfig, TrainConfig
from car_jax.train.sft import world_demos, write_demos
from car_jax.train.trainer import train

PROGRESS_FILE = "progress.jsonl"
EVAL_MODES = {"search": "search", "tir": "tir"}  # training template -> eval mode


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str  # "warm", "train/car-s0", "eval/car-s0/id", "equivalence/mscr"
    kind: str  # warm | train | eval | equivalence
    dir: Path
    config: object  # TrainConfig (warm, train, equivalence) or EvalConfig (eval)


def _train(cfg: ExperimentConfig, run_dir: Path, **changes) -> TrainConfig:
    """cfg.train with `changes` (sections replaced whole) and run.dir = run_dir."""
    out = dataclasses.replace(cfg.train, **changes)
    return dataclasses.replace(out, run=dataclasses.replace(out.run, dir=str(run_dir)))


def equivalence_rewards(b: float, format_penalty: float) -> dict[str, RewardConfig]:
    """MSCR(b1 = b2 = b, lambda) and weighted Brier(w = b / (1 + b), lambda / (1 + b)): the
    second is the first divided by 1 + b, format penalty included."""
    return {"mscr": RewardConfig(kind="mscr", b1=b, b2=b, format_penalty=format_penalty),
            "weighted_brier": RewardConfig(kind="weighted_brier", weight=b / (1 + b),
                                           format_penalty=format_penalty / (1 + b))}


def plan(cfg: ExperimentConfig) -> list[Unit]:
    """Every unit of the experiment, in the order they run."""
    root, t = Path(cfg.dir), cfg.train
    if t.data.template not in EVAL_MODES:
        raise ValueError(f"train.data.template={t.data.template!r}: the experiment evaluates search or tir "
                         f"agents; use one of {sorted(EVAL_MODES)}")
    warm_dir = root / "warm"
    w = cfg.warm_start
    units = [Unit("warm", "warm", warm_dir, _train(
        cfg, warm_dir, seed=cfg.seeds[0], rl=dataclasses.replace(t.rl, steps=0),
        sft=SFTConfig(data=str(warm_dir / "demos.jsonl"), steps=w.steps, batch=w.batch, lr=w.lr),
        run=dataclasses.replace(t.run, export_hf=True)))]
    warm_model = dataclasses.replace(t.model, path=str(warm_dir / "hf"))

    def evals(policy: str, model: Path) -> list[Unit]:
        return [Unit(f"eval/{policy}/{split}", "eval", root / "evals" / policy / split, EvalConfig(
            seed=0, mode=EVAL_MODES[t.data.template], batch_size=cfg.eval.batch_size,
            model=EvalModelConfig(path=str(model), dtype=t.model.dtype), data=data, tools=t.tools,
            episode=cfg.eval.episode,
            output=OutputConfig(dir=str(root / "evals" / policy / split), resume=True, n_boot=0)))
            for split, data in cfg.eval.splits.items()]

    # seed-major, each policy evaluated as soon as it is trained: an experiment stopped part
    # way holds whole seeds of every arm, a balanced comparison, rather than all of one arm
    units += evals("warm", warm_dir / "hf")
    for seed in cfg.seeds:
        for arm, reward in cfg.arms.items():
            d = root / "runs" / f"{arm}-s{seed}"
            units.append(Unit(f"train/{arm}-s{seed}", "train", d, _train(
                cfg, d, seed=seed, reward=reward, model=warm_model, sft=SFTConfig(),
                run=dataclasses.replace(t.run, export_hf=True))))
            units += evals(f"{arm}-s{seed}", d / "hf")
    eq = cfg.equivalence
    if eq.steps:
        for name, reward in equivalence_rewards(eq.b, t.reward.format_penalty).items():
            d = root / "equivalence" / name
            units.append(Unit(f"equivalence/{name}", "equivalence", d, _train(
                cfg, d, seed=cfg.seeds[0], reward=reward, model=warm_model, sft=SFTConfig(),
                rl=dataclasses.replace(t.rl, steps=eq.steps),
                run=dataclasses.replace(t.run, export_hf=False, tensorboard=False))))
    return units


def is_done(unit: Unit) -> bool:
    """A training unit: its last_step.json says its final step (and hf/ is there when it
    exports); an eval unit: its summary.json covers every example of the split."""
    if unit.kind == "eval":
        summary = unit.dir / "summary.json"
        if not summary.is_file():
            return False
        d = unit.config.data
        return json.loads(summary.read_text()).get("n") == len(load_dataset(d.path, split=d.split, limit=d.limit))
    last = unit.dir / "last_step.json"
    if not last.is_file() or json.loads(last.read_text()).get("step") != unit.config.rl.steps:
        return False
    return not unit.config.run.export_hf or (unit.dir / "hf" / "config.json").is_file()


def write_warm_demos(cfg: TrainConfig, confidence, limit: int | None) -> Path:
    """The warm start's demonstrations (`sft.world_demos`) over the training questions,
    searched with the training retriever, written to cfg.sft.data (kept if present)."""
    path = Path(cfg.sft.data)
    if path.is_file():
        return path
    examples = load_dataset(cfg.data.train, cfg.data.train_split, limit or cfg.data.limit)
    with open_tools("search", cfg.tools) as box:
        demos = world_demos(examples, box.tools["search"], cfg.data.template, confidence=confidence, seed=cfg.seed)
    tmp = write_demos(demos, path.with_suffix(".partial"))
    tmp.rename(path)
    return path


def run_unit(unit: Unit, cfg: ExperimentConfig, log: Callable = print) -> None:
    """Runs (or resumes) one unit in this process."""
    if unit.kind == "eval":
        run_eval(unit.config, label=unit.name, log=log)
        return
    if unit.kind == "warm":
        write_warm_demos(unit.config, cfg.warm_start.confidence, cfg.warm_start.limit)
    train(unit.config)


def run_experiment(cfg: ExperimentConfig, only: str | None = None, log: Callable = print) -> list[Unit]:
    """Runs every unit that is not done yet (those whose name starts with `only`, if given),
    in plan order; returns the units it ran. A unit's failure stops the experiment (the
    error propagates); running again resumes."""
    units = [u for u in plan(cfg) if only is None or u.name.startswith(only)]
    if only is not None and not units:
        raise ValueError(f"--only {only!r} matches no unit; units are named like {plan(cfg)[1].name!r}")
    Path(cfg.dir).mkdir(parents=True, exist_ok=True)
    ran = []
    for i, unit in enumerate(units, 1):
        if is_done(unit):
            continue
        log(f"\n== experiment unit {i}/{len(units)}: {unit.name} ({unit.dir}) ==")
        start = time.perf_counter()
        run_unit(unit, cfg, log)
        gc.collect()
        seconds = time.perf_counter() - start
        with open(Path(cfg.dir) / PROGRESS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"unit": unit.name, "seconds": round(seconds, 1), "time": time.time()}) + "\n")
        ran.append(unit)
    return ran


def status(cfg: ExperimentConfig) -> list[tuple[str, bool]]:
    """(unit name, done) for every unit."""
    return [(u.name, is_done(u)) for u in plan(cfg)]
