"""The reward experiment: one shared SFT warm start, GRPO runs per reward arm and seed, greedy
evaluations of every final policy, and a report rebuilt from the run folders
(`car-jax experiment`; configs/experiment/)."""
from car_jax.experiment.config import ExperimentConfig
from car_jax.experiment.report import write_report
from car_jax.experiment.runner import plan, run_experiment, status

__all__ = ["ExperimentConfig", "plan", "run_experiment", "status", "write_report"]
