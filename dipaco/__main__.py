"""`python -m dipaco` is the `dipaco` command (islands and baselines are started this way)."""

import sys

from dipaco.cli import main

sys.exit(main())
