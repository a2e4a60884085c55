#!/usr/bin/env bash
# The main job: installs hora, then trains the MNIST example on 2 processes with `hora run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec hora run -np 2 python examples/pytorch_mnist.py "$@"
