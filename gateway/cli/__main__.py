"""`python -m gateway.cli ...`: the `kvgate` command without its console script."""

import sys

from gateway.cli import main

sys.exit(main())
