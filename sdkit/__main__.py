"""`python -m sdkit`, the same as the `sdkit` command."""

import sys

try:  # Ctrl-C this early still gets one line and 130, not a traceback
    from .cli import run
except KeyboardInterrupt:
    print("sdkit: interrupted", file=sys.stderr)
    sys.exit(130)

run()
