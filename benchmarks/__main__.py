"""``python -m benchmarks``: run every benchmark (see :mod:`benchmarks.run_all`)."""

import sys

from benchmarks.run_all import main

sys.exit(main())
