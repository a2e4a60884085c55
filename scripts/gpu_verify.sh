#!/usr/bin/env bash
# What to run on a machine with one NVIDIA GPU to verify hora's CUDA paths (docs/gpu.md).
#
#   bash scripts/gpu_verify.sh RESULTS_DIR
#
# Made for one unattended run on a machine without network: hora need not be installed (the
# script tries `pip install --no-deps --no-build-isolation -e .`, which downloads nothing, and
# else puts src/ on PYTHONPATH), every step runs under `timeout` within one time budget
# (GPU_VERIFY_BUDGET seconds; default 330 with one GPU, so the whole script ends within 6
# minutes, and 540 with several), and a step that fails or times out does not stop the steps
# after it. The exit status is non-zero when any step failed, timed out or was not run for want
# of time.
#
# Writes into RESULTS_DIR:
#   summary.txt   one line per step, "ok" or "FAIL", with its seconds and its file; written as
#                 each step ends, so it is there even when the run is cut short
#   env.txt       nvidia-smi, driver, CUDA, NCCL and torch versions, the python, which hora
#   install.txt   how hora was made importable (installed, pip install -e, or PYTHONPATH)
#   tests.txt     every CUDA test, verbose (tests.xml: the same as JUnit XML); none may fail,
#                 nor skip for want of a GPU
#   bench_allreduce_cuda.{txt,json,csv,log}   hora bench allreduce --device cuda: hora on
#                 NCCL, hora staged through pinned memory, torch's NCCL, one rank per GPU (on
#                 one GPU: a world of one, which hora runs without an engine round)
#   bench_shared_gpu.{txt,json,log}   one GPU: two ranks sharing it through the staged path
#   bench_hora_staged_np2.txt   one GPU: the synthetic benchmark (ResNet-50), two ranks on it,
#                 staged
#   bench_hora_nccl.txt, bench_ddp.txt   the synthetic benchmark (ResNet-50), one rank, with
#                 hora on NCCL and torch DDP on NCCL
#   bench_hora_nccl_npN.txt, bench_ddp_npN.txt   several GPUs: the same on every GPU
#   scaling_cuda.{txt,log}, scaling_cuda/   a short hora bench scaling on CUDA (ResNet-50,
#                 hora on NCCL and DDP on NCCL, one rank, and on every GPU when there are
#                 several) with GPU utilisation per configuration and its number of samples
#   bench_world_of_one_engine.{txt,json,log}   one GPU: the world of one through the engine
#                 (HORA_LOCAL_SETS=0), the path before sets of one ran locally, to compare
#
# Settings: PYTHON (default python3), HORA (a `hora` launcher to use instead of the python
# module), GPU_VERIFY_BUDGET (seconds), GPU_VERIFY_NO_INSTALL=1 (skip pip; use PYTHONPATH).
set -uo pipefail
if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_verify.sh RESULTS_DIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)  # relative to where the script was started
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
BUDGET=${GPU_VERIFY_BUDGET:-330}  # set again once the GPUs are counted, unless given
DEADLINE=$((SECONDS + BUDGET))
FAILED=0
: > "$OUT/summary.txt"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "gpu_verify: $(date '+%Y-%m-%d %H:%M:%S'), budget ${BUDGET}s, in $PWD"
HAVE_TIMEOUT=1
command -v timeout > /dev/null || HAVE_TIMEOUT=0

# run LIMIT LOG CMD...: CMD with stdout and stderr to LOG (stderr to ERRLOG instead when that is
# set), under `timeout` for at most LIMIT seconds or what is left of the budget. Sets RC (124 or
# 137: timed out; 125: not run, the budget is spent) and STARTED.
run() {
    local want=$1 log=$2
    shift 2
    local err=${ERRLOG:-$log} left=$((DEADLINE - SECONDS - 5))
    local limit=$((want < left ? want : left))
    STARTED=$SECONDS
    echo "== $(date +%T) ${log##*/}: $* (limit ${limit}s)"
    if [ "$limit" -lt 20 ]; then
        echo "not run: the time budget (${BUDGET}s) was spent" | tee "$log" > "$err"
        RC=125
        return
    fi
    local limiter=(env)
    [ "$HAVE_TIMEOUT" -eq 1 ] && limiter=(timeout --kill-after=15 "$limit")
    if [ "$err" = "$log" ]; then
        "${limiter[@]}" "$@" > "$log" 2>&1
    else
        "${limiter[@]}" "$@" > "$log" 2> "$err"
    fi
    RC=$?
}

# verdict NAME FILE [CHECK_FAILED_WHY]: one line in summary.txt for the step `run` just ran;
# a third argument, when not empty, fails a step that exited 0.
verdict() {
    local name=$1 file=$2 why=${3:-} secs=$((SECONDS - STARTED))
    if [ "$RC" -eq 125 ]; then
        summary "FAIL  $name: not run, the time budget was spent ($file)"
    elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
        summary "FAIL  $name: timed out after ${secs}s ($file)"
    elif [ "$RC" -ne 0 ]; then
        summary "FAIL  $name: exit $RC after ${secs}s ($file)"
    elif [ -n "$why" ]; then
        summary "FAIL  $name: $why after ${secs}s ($file)"
    else
        summary "ok    $name: ${secs}s ($file)"
        return 0
    fi
    FAILED=1
    if { [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; } && command -v nvidia-smi > /dev/null; then
        # what a step that timed out left on the GPU
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv \
            >> "$OUT/$file" 2>&1 || true
    fi
    return 1
}

# 1. hora importable from this checkout, without network
hora_here() {  # 0 when $PY imports hora from ./src
    "$PY" - "$PWD/src" <<'PY' > /dev/null 2>&1
import os, sys
import hora
sys.exit(0 if os.path.realpath(hora.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
         else 1)
PY
}
STARTED=$SECONDS
{
    echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
    if hora_here; then
        HOW="already installed from this checkout"
    elif [ "${GPU_VERIFY_NO_INSTALL:-0}" != 1 ] \
        && PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 timeout 120 \
            "$PY" -m pip install --no-deps --no-build-isolation -e . && hora_here; then
        HOW="pip install --no-deps --no-build-isolation -e ."
    else
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
        HOW="not installed: PYTHONPATH=$PYTHONPATH"
    fi
    echo "hora: $HOW"
    # `hora` on PATH (tests and the lab may call the command): a shim when there is none
    if ! command -v hora > /dev/null || [ "$HOW" != "${HOW#not installed}" ]; then
        SHIM=$(mktemp -d "${TMPDIR:-/tmp}/hora-bin.XXXXXX")
        printf '#!/bin/sh\nexec %q -c %q "$@"\n' "$(command -v "$PY")" \
            "import sys; from hora.launch.cli import main; sys.exit(main())" > "$SHIM/hora"
        chmod +x "$SHIM/hora"
        trap 'rm -rf "$SHIM"' EXIT
        export PATH="$SHIM:$PATH"
        echo "hora command: $SHIM/hora (runs hora.launch.cli:main)"
    fi
    "$PY" -c "import hora; print('hora imported from', hora.__file__)"
} > "$OUT/install.txt" 2>&1
RC=1
grep -q "^hora imported from $PWD/src/" "$OUT/install.txt" && RC=0
# the launcher: `hora run` through the python module, so no console script is needed
if [ -n "${HORA:-}" ]; then
    HORA_RUN=("$HORA" run)
else
    HORA_RUN=("$PY" -c "import sys; from hora.launch.cli import main; sys.exit(main())" run)
fi
verdict "hora importable ($(grep '^hora: ' "$OUT/install.txt" | cut -c7-))" install.txt

# 2. the machine
# shellcheck disable=SC2317  # run through `bash -c env_report`
env_report() {
    echo "== nvidia-smi"; nvidia-smi || echo "nvidia-smi failed"
    echo "== driver"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    echo "== source"; git log -1 --format='%H %s' 2>/dev/null || echo "not a git checkout"
    git status --short 2>/dev/null | head -20
    echo "== python, torch, CUDA, NCCL, hora"
    "$PY" - <<'PY'
import sys
import torch
import torch.distributed as dist
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0", torch.cuda.get_device_name(0))
print("nccl available", dist.is_available() and dist.is_nccl_available())
if torch.cuda.is_available():
    print("nccl version", ".".join(map(str, torch.cuda.nccl.version())))
import hora
print("hora", hora.__file__)
sys.exit(0 if torch.cuda.is_available() else 3)
PY
}
export -f env_report
export PY
run 60 "$OUT/env.txt" bash -c env_report
WHY=""
if [ "$RC" -eq 3 ]; then
    RC=0
    WHY="torch.cuda.is_available() is False: a CUDA build of PyTorch and a GPU are needed"
fi
verdict "environment" env.txt "$WHY"
cat "$OUT/env.txt"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
[ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
if [ -z "${GPU_VERIFY_BUDGET:-}" ] && [ "$NGPU" -gt 1 ]; then
    BUDGET=540  # the multi-rank tables and ResNet-50 on every GPU come on top
    DEADLINE=$((DEADLINE + 540 - 330))
fi
summary "GPUs: $NGPU; budget ${BUDGET}s"

# 3. the CUDA tests: the unit tests of the stream/event and pinned-memory paths, the NCCL
# backend at np=1, the integration tests that run CUDA tensors through hora.torch, and no host
# synchronisation in steady-state training on NCCL
TESTS=(
    tests/unit/torch/test_device.py
    tests/unit/torch/test_device_staging.py
    tests/unit/backends/test_nccl_backend.py
    tests/unit/backends/test_nccl_settings.py
    tests/unit/backends/test_nccl_device_buffers.py
    tests/unit/torch/test_device_direct.py
    tests/integration/test_no_host_sync.py
    tests/integration/test_device_buffers.py
    tests/integration/test_torch_cuda.py
    tests/integration/test_backends.py
    tests/integration/test_data_arriving.py
    tests/unit/lab/test_gpu_bench.py
    tests/unit/lab/test_gpu_sampler.py
    tests/integration/test_world_of_one.py::test_cuda_tensors_alone_give_the_engines_bits_on_a_gpu
)
run 170 "$OUT/tests.txt" "$PY" -m pytest -v -rs -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/tests.xml" "${TESTS[@]}"
WHY=""
if grep -E "SKIPPED.*(GPU|CUDA)" "$OUT/tests.txt" | grep -qv "machines without a GPU"; then
    WHY="tests skipped for want of a GPU on a GPU machine"
fi
TALLY=$(grep -E '^=+ .*(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/tests.txt" | tail -1 \
    | tr -d '=' | xargs)
verdict "CUDA tests (${TALLY:-no tally})" tests.txt "$WHY"

# 4. the lab on the GPU: allreduce of CUDA tensors against torch's NCCL, one rank per GPU;
# on one GPU a world of one, whose ops hora runs where the tensor lies, without an engine round
# (the "vs nccl" column: hora's call against torch's own)
allreduce_bench() {  # name, limit, env..., -- lab arguments...
    local name=$1 limit=$2
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    ERRLOG="$OUT/$name.log" run "$limit" "$OUT/$name.txt" env "${envs[@]}" \
        "$PY" -m hora.lab allreduce --device cuda --timeout 60 --json "$OUT/$name.json" "$@"
}
allreduce_bench bench_allreduce_cuda 120 -- --np "$NGPU" --sizes 4K,1M,64M \
    --csv "$OUT/bench_allreduce_cuda.csv"
WHY=""
grep -q "^skipped" "$OUT/bench_allreduce_cuda.txt" && WHY="a backend was skipped"
verdict "hora bench allreduce --device cuda --np $NGPU" bench_allreduce_cuda.txt "$WHY"

# the synthetic benchmark on the GPU (it uses CUDA whenever torch sees a GPU)
ARGS=(--model resnet50 --batch-size 64 --num-warmup-batches 5 --num-batches-per-iter 5
    --num-iters 3)
bench() {  # name, ranks, limit, env..., -- args...
    local name=$1 np=$2 limit=$3
    shift 3
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    run "$limit" "$OUT/bench_$name.txt" env "${envs[@]}" "${HORA_RUN[@]}" -np "$np" \
        "$PY" examples/pytorch_synthetic_benchmark.py "$@"
    local rate why=""
    rate=$(grep -E 'Total img/sec' "$OUT/bench_$name.txt" | tail -1 | sed 's/^.*Total/Total/')
    [ -z "$rate" ] && why="no 'Total img/sec' line"
    verdict "benchmark $name${rate:+: $rate}" "bench_$name.txt" "$why"
}
QUIET=HORA_LOG_LEVEL=WARNING
SHORT=(--model resnet50 --batch-size 32 --num-warmup-batches 2 --num-batches-per-iter 3
    --num-iters 2)

# 5. one GPU: two ranks share it through the staged path (NCCL cannot put two ranks on one
# GPU; hora's staged path reduces in host memory, as people debugging on one GPU need)
if [ "$NGPU" -eq 1 ]; then
    allreduce_bench bench_shared_gpu 60 -- --np 2 --backends hora-staged --sizes 4K,1M,64M
    WHY=""
    grep -q "^skipped" "$OUT/bench_shared_gpu.txt" && WHY="the staged path was skipped"
    verdict "two ranks on one GPU, staged: hora bench allreduce --np 2" bench_shared_gpu.txt \
        "$WHY"
    bench hora_staged_np2 2 75 HOROVOD_CPU_OPERATIONS=native "$QUIET" -- "${SHORT[@]}"
fi

# 6. ResNet-50 on one GPU with hora on NCCL and with DDP on NCCL (the fair peer on GPUs); with
# several GPUs, on every GPU too
bench hora_nccl 1 90 HOROVOD_GPU_OPERATIONS=NCCL "$QUIET" -- "${ARGS[@]}"
bench ddp 1 90 "$QUIET" -- "${ARGS[@]}" --ddp
if [ "$NGPU" -gt 1 ]; then
    bench "hora_nccl_np$NGPU" "$NGPU" 120 HOROVOD_GPU_OPERATIONS=NCCL "$QUIET" -- "${ARGS[@]}"
    bench "ddp_np$NGPU" "$NGPU" 120 "$QUIET" -- "${ARGS[@]}" --ddp
fi

# 7. a scaling run on CUDA with GPU utilisation per configuration: enough timed steps (40 of
# about 40 ms) for the utilisation to rest on tens of samples (the table says how many)
NPS=1
[ "$NGPU" -gt 1 ] && NPS="1,$NGPU"
ERRLOG="$OUT/scaling_cuda.log" run 150 "$OUT/scaling_cuda.txt" \
    "$PY" -m hora.lab scaling --device cuda --model resnet50 --backends nccl,ddp --np "$NPS" \
    --steps 40 --warmup 5 --timeout 90 --out "$OUT/scaling_cuda"
WHY=""
grep -q "GPU util mean / max" "$OUT/scaling_cuda.txt" || WHY="no GPU utilisation in the table"
grep -q "too few" "$OUT/scaling_cuda.txt" && WHY="a GPU utilisation rests on too few samples"
grep -q "^failed" "$OUT/scaling_cuda.txt" && WHY="a configuration failed"
verdict "hora bench scaling --device cuda --np $NPS" scaling_cuda.txt "$WHY"

# 8. one GPU: the world of one through the engine, as before sets of one ran locally (compare
# its hora rows with step 4's)
if [ "$NGPU" -eq 1 ]; then
    allreduce_bench bench_world_of_one_engine 60 HORA_LOCAL_SETS=0 -- --np 1 \
        --backends hora-nccl,hora-staged --sizes 4K,64M
    verdict "world of one through the engine (HORA_LOCAL_SETS=0)" \
        bench_world_of_one_engine.txt
fi

if [ "$FAILED" -eq 0 ]; then
    summary "done in ${SECONDS}s: every step passed; results in $OUT"
else
    summary "done in ${SECONDS}s: $(grep -c '^FAIL' "$OUT/summary.txt") step(s) failed; results in $OUT"
fi
exit "$FAILED"
