"""``python -m hora.lab <benchmark> [options]``: run one of hora's benchmarks."""

from __future__ import annotations

import sys

from hora.lab import main

if __name__ == "__main__":
    sys.exit(main())
