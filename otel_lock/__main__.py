"""`python -m otel_lock` runs the `otel-lock` command."""

import sys

from .cli import main

sys.exit(main())
