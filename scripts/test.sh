#!/usr/bin/env bash
# The test command: installs hora with every extra (`scripts/install.sh --all`, into the
# project's virtual environment .venv unless one is active or PYTHON is set: scripts/venv.sh),
# checks style, then runs every test that can run on this machine (GPU and multi-host tests skip
# with their reason where they cannot), the quick unit tests first, one line per test file.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
hora_select_python "$PWD"
_HORA_PY_CHOSEN=$HORA_PY bash scripts/install.sh --all
hora_venv_note
PY=$HORA_PY
hora_do "$PY" -m ruff check src tests examples
hora_do "$PY" -m mypy
hora_log "running the tests: unit tests first, then the conformance suite, then the integration" \
  "tests (launcher, faults, TensorFlow, Spark, Ray, several hosts); one line per test file, about" \
  "35 minutes on two idle cores"
hora_do "$PY" -m pytest -rs "$@"
