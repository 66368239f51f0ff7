"""`python -m car_jax.cli`: the same as the `car-jax` command."""
import sys

from car_jax.cli import main

sys.exit(main())
