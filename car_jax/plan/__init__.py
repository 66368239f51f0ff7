"""`car-jax plan`: whether a training config fits its chips, per device, without weights
(`plan.make_plan`), and XLA's own accounting of the same programs (`xla.xla_memory`)."""
from car_jax.plan.arch import model_config, shipped_models
from car_jax.plan.plan import Plan, config_mesh, make_plan, max_rollout_rows, parse_mesh
from car_jax.plan.report import format_table

__all__ = ["Plan", "config_mesh", "format_table", "make_plan", "max_rollout_rows", "model_config", "parse_mesh",
           "shipped_models"]
