#!/usr/bin/env bash
# The test command: installs hora with every extra (`scripts/install.sh --all`, into the
# project's virtual environment .venv unless one is active or PYTHON is set: scripts/venv.sh),
# checks style, then runs every test that can run on this machine (GPU and multi-host tests skip
# with their reason where they cannot), on two pytest workers (pytest-xdist; HORA_TEST_WORKERS
# sets how many, 1 runs them in this process one after another), with the type check beside
# them. Fails if a test or the type check does.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
hora_select_python "$PWD"
_HORA_PY_CHOSEN=$HORA_PY bash scripts/install.sh --all
hora_venv_note
PY=$HORA_PY
hora_do "$PY" -m ruff check src tests examples
# mypy takes a minute of one core. The tests leave part of the second idle (their ranks wait on
# one another), so it runs beside them; its verdict is shown, and counts, when they end.
mypy_pid=
if hora_dry_run; then
  hora_do "$PY" -m mypy
else
  mypy_log=$(mktemp "${TMPDIR:-/tmp}/hora-mypy.XXXXXX")
  "$PY" -m mypy >"$mypy_log" 2>&1 &
  mypy_pid=$!
  trap '[ -z "$mypy_pid" ] || kill "$mypy_pid" 2>/dev/null; rm -f "$mypy_log"' EXIT
fi
# Most tests start ranks that wait on each other part of the time: one process kept about one
# core of two busy, two workers about 1.75 (CPU over wall time); a test file goes to one worker
# whole, so a module's shared Spark session or Ray cluster is made once (pytest-xdist hands out
# the files with most tests first).
WORKERS=${HORA_TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
hora_log "running the tests on $WORKERS worker(s): the unit tests, the conformance suite and the" \
  "integration tests (launcher, faults, TensorFlow, Spark, Ray, several hosts); about 28" \
  "minutes on two idle cores"
# the slowest tests are listed at the end: where to look when the run grows
status=0
hora_do "$PY" -m pytest -rs --durations=20 ${XDIST[@]+"${XDIST[@]}"} "$@" || status=$?
if [ -n "$mypy_pid" ]; then
  mypy_status=0
  wait "$mypy_pid" || mypy_status=$?
  mypy_pid=
  echo "mypy: $(cat "$mypy_log")"  # the trap removes the log on the way out
  if [ "$mypy_status" != 0 ]; then
    hora_log "mypy found type errors (above): the run fails"
    status=1
  fi
fi
exit "$status"
