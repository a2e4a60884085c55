#!/usr/bin/env bash
# The main job: installs what it needs (torch, CPU wheels where there is no NVIDIA GPU,
# scikit-learn and hora; `scripts/install.sh`, into the project's virtual environment .venv
# unless one is active or PYTHON is set: scripts/venv.sh), then trains the MNIST example on 2
# processes with `hora run`.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
hora_select_python "$PWD"
_HORA_PY_CHOSEN=$HORA_PY bash scripts/install.sh
hora_venv_note
if hora_dry_run; then
  echo "+ hora run -np 2 $HORA_PY examples/pytorch_mnist.py $*"
  exit 0
fi
exec "$HORA_PY" -c 'import sys; from hora.launch.cli import main; sys.exit(main())' \
  run -np 2 "$HORA_PY" examples/pytorch_mnist.py "$@"
