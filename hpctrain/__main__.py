"""`python -m hpctrain [plan|preflight] [overrides]`: see hpctrain.cli."""

import sys

from hpctrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
