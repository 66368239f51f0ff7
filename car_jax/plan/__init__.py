"""`car-jax plan`: whether a training config fits its chips, per device, without weights
(`plan.make_plan`), XLA's own accounting of the same programs (`xla.xla_memory`), and the
table of a folder of configs sized to fit their chips (`fit.fit_document`, docs/PLAN.md)."""
from car_jax.plan.arch import model_config, shipped_models
from car_jax.plan.fit import fit_document, plan_config
from car_jax.plan.plan import Plan, config_mesh, make_plan, max_rollout_rows, parse_mesh
from car_jax.plan.report import format_table

__all__ = ["Plan", "config_mesh", "fit_document", "format_table", "make_plan", "max_rollout_rows", "model_config",
           "parse_mesh", "plan_config", "shipped_models"]
