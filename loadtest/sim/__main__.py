"""`python -m loadtest.sim ...`: the same as `kvgate sim ...`."""

import sys

from loadtest.sim.cli import main

sys.exit(main(sys.argv[1:]))
