"""`python -m otel_lock.cli` runs the `otel-lock` command."""

import sys

from . import main

sys.exit(main())
