#!/usr/bin/env bash
# Installs hora on a fresh Debian-like machine, into the project's virtual environment (.venv)
# unless an environment or interpreter is chosen (scripts/venv.sh says how it picks).
#
#   bash scripts/install.sh          what the main job needs: torch (CPU wheels where there is
#                                    no NVIDIA GPU), scikit-learn and hora (scripts/train.sh)
#   bash scripts/install.sh --all    also every extra the tests use (TensorFlow, Ray, PySpark,
#                                    mpi4py, ruff, mypy, pytest...) and, as root with apt-get,
#                                    Open MPI's runtime, sshd, iproute2 and Java
#                                    (scripts/test.sh, CI, the images in deploy/)
#   --dry-run (or HORA_INSTALL_DRY_RUN=1)   prints the apt-get and pip commands instead of
#                                    running them (the virtual environment is still made)
#
# HORA_TORCH_INDEX_URL: torch's wheel index. Unset: https://download.pytorch.org/whl/cpu (CPU
# wheels, about 190 MB) when no NVIDIA GPU is seen (no nvidia-smi, no /proc/driver/nvidia),
# else pip's default index, whose Linux wheels carry CUDA and NCCL (several GB). Set to a URL:
# that index; set empty: pip's default index whatever the machine has.
# Safe to run again: every step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh

all=0
for arg in "$@"; do
  case $arg in
    --all) all=1 ;;
    --dry-run) export HORA_INSTALL_DRY_RUN=1 ;;
    *) hora_die "install.sh: unknown argument $arg (known: --all, --dry-run)" ;;
  esac
done

if [ "$all" = 1 ]; then
  # System packages, only as root and only what is missing: Open MPI's runtime (the MPI backend
  # and the mpirun tests; mpi4py comes as a binary wheel that loads it, so no compiler or MPI
  # headers), sshd (multi-host tests), iproute2 (network namespaces), Java (pyspark). No
  # recommended extras. apt's output goes to a log; one line says what was installed. The
  # container recipes in deploy/ run this too.
  need=()
  command -v mpirun >/dev/null || need+=(openmpi-bin)
  [ -x /usr/sbin/sshd ] || need+=(openssh-server openssh-client)
  command -v ip >/dev/null || need+=(iproute2)
  command -v java >/dev/null || need+=(openjdk-17-jre-headless)
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt_log=${TMPDIR:-/tmp}/hora-apt.log
      hora_log "installing system packages with apt-get: ${need[*]} (and what they need;" \
        "log: $apt_log)"
      if hora_dry_run; then
        hora_do apt-get update -qq
        hora_do apt-get install -y -qq --no-install-recommends "${need[@]}"
      elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$apt_log" 2>&1; then
        tail -n 20 "$apt_log" >&2
        hora_die "apt-get could not install ${need[*]} (the whole log: $apt_log)"
      else
        hora_log "apt-get installed $(grep -c '^Setting up' "$apt_log") packages" \
          "(remove them with: apt-get remove ${need[*]} && apt-get autoremove)"
      fi
    else
      hora_log "missing ${need[*]} (not root or no apt-get): the tests that need them skip"
    fi
  fi
fi

hora_select_python "$PWD"
PY=$HORA_PY

# torch first and pinned: any other version would pull gigabytes of CUDA packages. A torch 2.13.0
# already there (any build: +cpu, CUDA) is kept, and no index is asked.
torch_now=$("$PY" -c 'from importlib.metadata import version; print(version("torch"))' \
  2>/dev/null || true)
# Whether an index answers, asked once with a short timeout (pip itself would retry a closed
# one for half a minute).
index_answers() {
  "$PY" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5)
EOF
}
if [ "${torch_now%%+*}" = 2.13.0 ]; then
  hora_log "torch $torch_now is installed already"
elif [ -z "${HORA_TORCH_INDEX_URL+set}" ]; then
  if command -v nvidia-smi >/dev/null || [ -e /proc/driver/nvidia ]; then
    HORA_TORCH_INDEX_URL=
    hora_log "an NVIDIA GPU driver is here: torch from pip's index (CUDA wheels)"
  elif hora_dry_run || index_answers https://download.pytorch.org/whl/cpu; then
    HORA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    hora_log "no NVIDIA GPU seen: torch's CPU wheels from $HORA_TORCH_INDEX_URL" \
      "(HORA_TORCH_INDEX_URL= picks pip's own index)"
  else
    HORA_TORCH_INDEX_URL=
    hora_log "torch's CPU index https://download.pytorch.org/whl/cpu does not answer here:" \
      "torch from pip's own index and find-links ($("$PY" -m pip config get global.index-url \
      2>/dev/null || echo PyPI)); where that has only CUDA wheels they are several GB." \
      "HORA_TORCH_INDEX_URL=URL picks another index"
  fi
fi
if [ "${torch_now%%+*}" != 2.13.0 ]; then
  torch_index=()
  [ -n "$HORA_TORCH_INDEX_URL" ] && torch_index=(--index-url "$HORA_TORCH_INDEX_URL" --retries 1)
  hora_do "$PY" -m pip install -q "${torch_index[@]}" "torch==2.13.0"
fi

extras="torch"  # torch and scikit-learn: examples/pytorch_mnist.py
if [ "$all" = 1 ]; then
  extras="$extras,lab,bf16,tensorflow,dev"  # TensorFlow (+ tf-keras), plots, ruff, mypy, pytest
  extras="$extras,spark"  # pyspark, for hora.spark and its tests
  command -v mpirun >/dev/null && extras="$extras,mpi"  # mpi4py's wheel
  extras="$extras,ray"  # hora.ray and its tests (Ray 2.60; leaves numpy and torch as they are)
fi
hora_do "$PY" -m pip install -q -e ".[${extras}]"
# An editable install leaves hora's own modules uncompiled, where pip compiles those of any
# other install. Where bytecode is not written at import (PYTHONDONTWRITEBYTECODE=1, as many
# container images set), every rank of every job would compile them again: 0.2 s of CPU per
# process for `import hora`, 0.6 s for hora.torch. Python checks a source's time stamp before
# it uses its bytecode, so an edited file is compiled afresh.
hora_do "$PY" -m compileall -q src
hora_venv_note
