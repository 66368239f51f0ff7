"""The experiment as a list of units, each a plain `car-jax train` or `car-jax eval` run in
its own folder, run in order and skipped when already complete:

    <dir>/warm/                   SFT warm start (rl.steps = 0) on demonstrations written to
                                  warm/demos.jsonl; its policy is warm/hf
    <dir>/runs/<arm>-s<seed>/     GRPO from warm/hf with the arm's reward, the seed, and the
                                  seed's data order (cfg.shuffle_seed: with data_order per_seed
                                  every arm of a seed sees the same prompts, seeds differ)
    <dir>/evals/<policy>/<split>/ the policy (warm, or a run) evaluated greedily on a split
    <dir>/equivalence/{mscr,weighted_brier}/  the two runs of the equivalence check
    <dir>/progress.jsonl          one line per finished unit: name, seconds, time

The order: the warm start and its evaluations, then seed by seed every arm's run, each
followed by its evaluations, then the equivalence runs.

A unit stopped half way (a kill, a crash, the end of a sitting) resumes where it stopped:
training from its latest checkpoint (`run.resume`), evaluation from its samples file
(`output.resume`). So `car-jax experiment` can be run again and again until every unit is
done, in as many sittings as it takes.

With `prune`, a policy's weights and checkpoints are deleted once its evaluations are done
(and the warm start's once no run needs it): the folder keeps the records the report reads
(configs, metrics, samples, summaries), a few MB instead of ~2 GB a run, small enough to copy
or commit. A folder whose warm start weights are gone (pruned, or a copy without them) rebuilds
them from warm/demos.jsonl before the next run that needs them, and checks the rebuilt
weights against the SHA-256 the first build recorded (warm/weights.sha256.json); the outcome
is a line in progress.jsonl and in the report.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import shutil
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
WARM_HASHES = "weights.sha256.json"  # in warm/: the first build's weight files -> SHA-256
REBUILT = "warm (rebuilt)"  # the progress line of a rebuild of the warm start's weights
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

    def seed_data(seed: int):  # run seed `seed`'s data order (cfg.data_order); the warm start keeps t.data
        return dataclasses.replace(t.data, shuffle_seed=cfg.shuffle_seed(seed))

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
                cfg, d, seed=seed, reward=reward, model=warm_model, sft=SFTConfig(), data=seed_data(seed),
                run=dataclasses.replace(t.run, export_hf=True))))
            units += evals(f"{arm}-s{seed}", d / "hf")
    eq = cfg.equivalence
    if eq.steps:
        for name, reward in equivalence_rewards(eq.b, t.reward.format_penalty).items():
            d = root / "equivalence" / name
            units.append(Unit(f"equivalence/{name}", "equivalence", d, _train(
                cfg, d, seed=cfg.seeds[0], reward=reward, model=warm_model, sft=SFTConfig(),
                data=seed_data(cfg.seeds[0]), rl=dataclasses.replace(t.rl, steps=eq.steps),
                run=dataclasses.replace(t.run, export_hf=False,  # no TensorBoard files; other loggers stay
                                        loggers=tuple(n for n in t.run.loggers if n != "tensorboard")))))
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


def _progress(cfg: ExperimentConfig, row: dict) -> None:
    with open(Path(cfg.dir) / PROGRESS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({**row, "time": time.time()}) + "\n")


def weight_hashes(hf: Path) -> dict[str, str]:
    """SHA-256 of each safetensors file in an exported HF folder ({} when there is none)."""
    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def ensure_warm_weights(cfg: ExperimentConfig, warm: Unit, log: Callable = print) -> None:
    """Rebuilds the warm start's weights when its unit is done but warm/hf holds none (a
    pruned folder, or a copy of the records only): the same SFT on the same demonstrations
    and seed. Compares them with the hashes of the first build and records the outcome in
    progress.jsonl; a rebuild that differs (another machine's arithmetic) is reported, not
    refused, as the runs already done started from the first build."""
    hf = warm.dir / "hf"
    if not is_done(warm) or weight_hashes(hf):
        return
    log(f"\n== the warm start's weights are not in {hf}: rebuilding them from {warm.config.sft.data} ==")
    start = time.perf_counter()
    train(warm.config)
    gc.collect()
    got = weight_hashes(hf)
    first = json.loads((warm.dir / WARM_HASHES).read_text()) if (warm.dir / WARM_HASHES).is_file() else None
    same = None if first is None else got == first
    log({True: "the rebuilt weights are identical to the first build's (SHA-256)",
         False: "WARNING: the rebuilt weights differ from the first build's: the runs still to come start "
                "from a warm start that is not bit-identical to the one the finished runs started from",
         None: f"no hashes of the first build ({WARM_HASHES}) to compare with"}[same])
    _progress(cfg, {"unit": REBUILT, "seconds": round(time.perf_counter() - start, 1), "identical": same})


def prune(cfg: ExperimentConfig, units: list[Unit] | None = None) -> list[Path]:
    """Deletes what the report does not read once nothing still to run needs it: checkpoints
    and weights of every policy whose evaluations are done (the warm start's weights only when
    every run and the equivalence check are done too). Keeps configs, metrics, samples,
    summaries and hf/config.json (a finished run stays done). Returns the deleted paths."""
    units = plan(cfg) if units is None else units
    done = {u.name: is_done(u) for u in units}
    gone = []
    for u in units:
        if u.kind == "eval" or not done[u.name]:
            continue
        policy = "warm" if u.kind == "warm" else u.name.split("/", 1)[1]
        if not all(d for name, d in done.items() if name.startswith(f"eval/{policy}/")):
            continue  # still to be evaluated (an equivalence run has no evaluations)
        paths = [u.dir / "checkpoints", u.dir / "warm_start"]
        if u.kind == "train" or (u.kind == "warm" and all(done.values())):
            paths += sorted((u.dir / "hf").glob("*.safetensors"))
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
            else:
                continue
            gone.append(p)
    return gone


def run_experiment(cfg: ExperimentConfig, only: str | None = None, log: Callable = print,
                   prune_done: bool = False) -> list[Unit]:
    """Runs every unit that is not done yet (those whose name starts with `only`, if given),
    in plan order; returns the units it ran. A unit's failure stops the experiment (the
    error propagates); running again resumes. With `prune_done`, `prune` after each unit."""
    every = plan(cfg)
    units = [u for u in every if only is None or u.name.startswith(only)]
    if only is not None and not units:
        raise ValueError(f"--only {only!r} matches no unit; units are named like {every[1].name!r}")
    Path(cfg.dir).mkdir(parents=True, exist_ok=True)
    if prune_done:  # what an earlier sitting finished without pruning
        prune(cfg, every)
    ran = []
    for i, unit in enumerate(units, 1):
        if is_done(unit):
            continue
        if unit.kind in ("train", "equivalence"):
            ensure_warm_weights(cfg, every[0], log)
        log(f"\n== experiment unit {i}/{len(units)}: {unit.name} ({unit.dir}) ==")
        start = time.perf_counter()
        run_unit(unit, cfg, log)
        gc.collect()
        _progress(cfg, {"unit": unit.name, "seconds": round(time.perf_counter() - start, 1)})
        if unit.kind == "warm":
            (unit.dir / WARM_HASHES).write_text(json.dumps(weight_hashes(unit.dir / "hf"), indent=1) + "\n")
        if prune_done:
            prune(cfg, every)
        ran.append(unit)
    return ran


def status(cfg: ExperimentConfig) -> list[tuple[str, bool]]:
    """(unit name, done) for every unit."""
    return [(u.name, is_done(u)) for u in plan(cfg)]
