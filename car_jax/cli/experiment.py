"""`car-jax experiment --config configs/experiment/X.yaml [key=value ...]`: the reward
experiment (`car_jax.experiment`): a shared SFT warm start, GRPO per reward arm and seed,
greedy evaluations, then the report (RESULTS.md, results.json, figures).

    car-jax experiment --config configs/experiment/world_car.yaml            # run or resume, then report
    car-jax experiment --config configs/experiment/world_car.yaml --status   # which units are done
    car-jax experiment --config ... --only train/car                      # units whose name starts so
    car-jax experiment --config ... --prune       # delete weights and checkpoints once nothing needs them
    car-jax experiment --config runs/experiment/experiment.yaml --report --report-to .

Every unit resumes where it stopped, so the command can be stopped (Ctrl-C, a kill) and run
again in as many sittings as it takes. The folder keeps the config it was started with
(<dir>/experiment.yaml); another config for the same folder is refused. A saved config from
before a key existed reads that key as the folder's runs used it (`data_order: shared` for the
folders made before each seed had its own data order).
"""
from __future__ import annotations

from car_jax.cli import add_config_args


def register(sub) -> None:
    p = sub.add_parser("experiment", help="vanilla vs RLCR vs CAR from one warm start, evaluated and reported")
    add_config_args(p, "keys of car_jax.experiment.config.ExperimentConfig", "seeds=[0] train.rl.steps=4")
    p.add_argument("--status", action="store_true", help="list the units and whether each is done")
    p.add_argument("--only", default=None, metavar="PREFIX", help="run only the units whose name starts with PREFIX")
    p.add_argument("--prune", action="store_true", help="delete each policy's weights and checkpoints once its "
                   "evaluations are done (the records the report reads stay; the warm start's weights are "
                   "rebuilt if a later run needs them)")
    p.add_argument("--report", action="store_true", help="rebuild the report from the run folders; run nothing")
    p.add_argument("--report-to", default=None, metavar="DIR", help="where RESULTS.md and its figures go "
                   "(default <dir>/report)")
    p.set_defaults(func=_run)


def _check_folder(cfg) -> None:
    """Writes <dir>/experiment.yaml, or refuses a folder started with another config (the
    saved file, read with today's defaults for keys it lacks, must equal `cfg`)."""
    from pathlib import Path

    from car_jax.config import ConfigError, save_config
    from car_jax.experiment.config import SAVED, load_experiment

    path = Path(cfg.dir) / SAVED
    if path.is_file():
        # read back through today's dataclasses: a key added to car_jax since the folder was
        # started takes its default on both sides and is not a difference, except the LEGACY
        # keys, which take the value the folder's runs used (load_experiment)
        if load_experiment(path) != cfg:
            raise ConfigError(f"dir: {cfg.dir} holds an experiment started with another config ({path}); "
                              f"rerun with --config {path}, or choose another dir=")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path)


def _load(args):
    """The experiment config of --config and the overrides; a folder's saved experiment.yaml
    keeps the meaning it had when its runs were made (`config.load_experiment`)."""
    from car_jax.cli import config_path
    from car_jax.config import ConfigError
    from car_jax.experiment.config import load_experiment

    try:
        return load_experiment(config_path(args), args.overrides)
    except FileNotFoundError as err:
        raise ConfigError(f"--config: {err}") from None


def _run(args) -> int:
    from pathlib import Path

    from car_jax.experiment import run_experiment, status, write_report

    cfg = _load(args)
    saved = str(Path(cfg.dir) / "experiment.yaml")
    commands = [f"car-jax experiment --config {saved}",
                f"car-jax experiment --config {saved} --report" + (f" --report-to {args.report_to}" if args.report_to else "")]
    if args.status:
        rows = status(cfg)
        for name, done in rows:
            print(f"{'done' if done else 'todo':4}  {name}")
        print(f"{sum(d for _, d in rows)} of {len(rows)} units done")
        return 0
    if not args.report:
        _check_folder(cfg)
        run_experiment(cfg, only=args.only, prune_done=args.prune)
        if not all(done for _, done in status(cfg)):
            print("some units are not done yet (--only); the report waits for all of them")
            return 0
    path = write_report(cfg, args.report_to, commands)
    print(path.read_text())
    print(f"wrote {path} and its figures")
    return 0
