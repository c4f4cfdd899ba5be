"""`python -m sdkit`, the same as the `sdkit` command."""

import sys

from .cli import main

sys.exit(main())
