#!/usr/bin/env bash
# The test command: installs what is needed, checks style, then runs every test that can run
# on this machine (GPU and multi-host tests skip with their reason where they cannot).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
$PY -m ruff check src tests examples
$PY -m mypy
$PY -m pytest -q -rs "$@"
