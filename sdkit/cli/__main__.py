"""`python -m sdkit.cli` (as `accelerate launch -m sdkit.cli ...` runs it): the `sdkit` command."""

from . import run

run()
