#!/usr/bin/env bash
# What to run on a many-core machine to see hora on one host at 2 to 16 ranks (issue: many
# ranks on one host; docs/benchmarks.md, "Many ranks on one host").
#
#   bash scripts/cpu_scaling.sh RESULTS_DIR
#
# Unattended and without network, on a machine whose python3 has torch (and perhaps mpi4py
# with mpirun): hora need not be installed (src/ goes on PYTHONPATH). Every step runs under
# `timeout` within one budget (CPU_SCALING_BUDGET seconds, default 290: done in under 5
# minutes on 16 cores); a step that fails or times out does not stop the ones after it. The
# exit status is non-zero when a step failed, timed out or was not run for want of time.
#
# Writes into RESULTS_DIR:
#   summary.txt         one line per step, "ok" or "FAIL", its seconds and its file
#   env.txt             cores, memory, Yama's ptrace_scope, python, torch, mpi4py, mpirun
#   shm_paths.txt       which shared-memory path every pair of ranks took (single copy or
#                       staged), at the largest allreduce np
#   allreduce_npN.{txt,json}   hora bench allreduce at N ranks: hora, Gloo and Open MPI from
#                       4 KiB to 64 MiB, and the bytes each rank moved per path (counted)
#   scaling.txt, scaling/      hora bench scaling: the MLP and the CNN, native against DDP
#
# Settings (the defaults are the many-core run; CI runs tiny ones): PYTHON (python3),
# CPU_SCALING_BUDGET, CPU_SCALING_NPS (2,4,8,16), CPU_SCALING_SIZES (4K,256K,1M,4M,64M),
# CPU_SCALING_ITERS (20), CPU_SCALING_BACKENDS (hora,gloo,mpi), CPU_SCALING_SCALE_NPS
# (1,4,8), CPU_SCALING_MODELS (mlp,cnn), CPU_SCALING_STEPS (10).
set -uo pipefail
if [ $# -ne 1 ]; then
    echo "usage: bash scripts/cpu_scaling.sh RESULTS_DIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
BUDGET=${CPU_SCALING_BUDGET:-290}
NPS=${CPU_SCALING_NPS:-2,4,8,16}
SIZES=${CPU_SCALING_SIZES:-4K,256K,1M,4M,64M}
ITERS=${CPU_SCALING_ITERS:-20}
BACKENDS=${CPU_SCALING_BACKENDS:-hora,gloo,mpi}
SCALE_NPS=${CPU_SCALING_SCALE_NPS:-1,4,8}
MODELS=${CPU_SCALING_MODELS:-mlp,cnn}
STEPS=${CPU_SCALING_STEPS:-10}
DEADLINE=$((SECONDS + BUDGET))
FAILED=0
: > "$OUT/summary.txt"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "cpu_scaling: $(date '+%Y-%m-%d %H:%M:%S'), budget ${BUDGET}s, in $PWD"
"$PY" -c "import hora" 2> /dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# step NAME FILE WANT CMD...: CMD (stdout to FILE, stderr to FILE.log) for at most WANT
# seconds or what is left of the budget, and its line in summary.txt
step() {
    local name=$1 file=$2 want=$3 left=$((DEADLINE - SECONDS - 5)) start=$SECONDS
    shift 3
    local limit=$((want < left ? want : left))
    if [ "$limit" -lt 10 ]; then
        summary "FAIL  $name: not run, the time budget was spent ($file)"
        FAILED=1
        return
    fi
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$file" 2> "$OUT/$file.log"
    local rc=$? secs=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        summary "ok    $name: ${secs}s ($file)"
    else
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && rc="timed out"
        summary "FAIL  $name: exit $rc after ${secs}s ($file)"
        FAILED=1
    fi
}

machine() {
    echo "cores: $(nproc) ($(grep -c ^processor /proc/cpuinfo) online)"
    grep -m1 "model name" /proc/cpuinfo
    grep MemTotal /proc/meminfo
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2> /dev/null \
        || echo 'no Yama (single-copy reads between sibling ranks allowed)')"
    uname -sr
    grep -h PRETTY_NAME /etc/os-release 2> /dev/null
    command -v mpirun > /dev/null && mpirun --version 2>&1 | head -1
    "$PY" -c "import sys, numpy; print('python', sys.version.split()[0], 'numpy', numpy.__version__)"
    "$PY" -c "import torch; print('torch', torch.__version__)" 2>&1
    "$PY" -c "import mpi4py; print('mpi4py', mpi4py.__version__)" 2>&1 | tail -1
    "$PY" -c "import hora; print('hora', hora.__file__)"
    git log -1 --format='source: %H %s' 2> /dev/null
}
export -f machine
export PY
step "environment" env.txt 30 bash -c machine

LAST=${NPS##*,}
step "shared-memory paths at np=$LAST" shm_paths.txt 60 \
    "$PY" -c "import sys; from hora.launch.cli import main; sys.exit(main())" run -np "$LAST" \
    "$PY" -c "
import numpy, hora, hora.core.runtime as rt
hora.init()
hora.allreduce(numpy.ones(4 << 20, numpy.float32), name='connect')  # pairs to every rank
t = rt.runtime().engine.transport
for p in range(t.size):
    if p != t.rank:
        print('rank', t.rank, '->', repr(t.pair(p)), flush=True)
hora.barrier()
hora.shutdown()"

for NP in ${NPS//,/ }; do
    step "hora bench allreduce --np $NP" "allreduce_np$NP.txt" 150 \
        "$PY" -m hora.lab allreduce --np "$NP" --sizes "$SIZES" --iters "$ITERS" \
        --backends "$BACKENDS" --timeout 120 --json "$OUT/allreduce_np$NP.json"
done

step "hora bench scaling --np $SCALE_NPS" scaling.txt 240 \
    "$PY" -m hora.lab scaling --device cpu --model "$MODELS" --backends native,ddp \
    --np "$SCALE_NPS" --steps "$STEPS" --warmup 3 --timeout 60 --out "$OUT/scaling"

if [ "$FAILED" -eq 0 ]; then
    summary "done in ${SECONDS}s: every step passed; results in $OUT"
else
    summary "done in ${SECONDS}s: $(grep -c '^FAIL' "$OUT/summary.txt") step(s) failed; results in $OUT"
fi
exit "$FAILED"
