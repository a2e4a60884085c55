#!/usr/bin/env bash
# What to run on a machine with one NVIDIA GPU to verify hora's CUDA paths (docs/gpu.md).
#
#   bash scripts/gpu_verify.sh RESULTS_DIR
#
# Writes into RESULTS_DIR: env.txt (nvidia-smi, driver, CUDA, NCCL and torch versions),
# tests.txt (every CUDA test; none may be skipped for want of a GPU), and one file per run of
# the synthetic benchmark on the GPU: hora with its CPU backend (CUDA tensors staged through
# pinned memory), hora with NCCL (HOROVOD_GPU_OPERATIONS=NCCL), and torch DDP for comparison;
# then the lab on the GPU: bench_allreduce_cuda.{txt,json,csv} (hora bench allreduce --device
# cuda: hora on NCCL, hora staged, torch's NCCL, one rank per GPU) and scaling_cuda.txt with
# scaling_cuda/ (a short hora bench scaling on CUDA, with GPU utilisation per configuration).
# Exits non-zero at the first failure; summary.txt says what passed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_verify.sh RESULTS_DIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
PY=${PYTHON:-python3}
HORA_RUN=("${HORA:-hora}" run)  # the launcher of the hora this python imports
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# 1. the machine
{
    echo "== nvidia-smi"; nvidia-smi || echo "nvidia-smi failed"
    echo "== driver"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    echo "== torch, CUDA, NCCL"
    "$PY" - <<'PY'
import torch
import torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0", torch.cuda.get_device_name(0))
print("nccl available", dist.is_available() and dist.is_nccl_available())
if torch.cuda.is_available():
    print("nccl version", ".".join(map(str, torch.cuda.nccl.version())))
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    summary "FAIL: torch.cuda.is_available() is False: install a CUDA build of PyTorch"
    exit 1
fi
summary "ok: environment (env.txt)"

# 2. the CUDA tests: the unit tests of the stream/event and pinned-memory paths, the NCCL
# backend at np=1, and the integration tests that run CUDA tensors through hora.torch
TESTS=(
    tests/unit/torch/test_device.py
    tests/unit/torch/test_device_staging.py
    tests/unit/backends/test_nccl_backend.py
    tests/unit/backends/test_nccl_settings.py
    tests/unit/backends/test_nccl_device_buffers.py
    tests/unit/torch/test_device_direct.py
    tests/integration/test_torch_cuda.py
    tests/integration/test_backends.py
    tests/integration/test_device_buffers.py
    tests/integration/test_data_arriving.py
    tests/unit/lab/test_gpu_bench.py
    tests/unit/lab/test_gpu_sampler.py
)
"$PY" -m pytest -q -rs "${TESTS[@]}" 2>&1 | tee "$OUT/tests.txt"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    summary "FAIL: CUDA tests (tests.txt)"
    exit 1
fi
if grep -E "SKIPPED.*(GPU|CUDA)" "$OUT/tests.txt" | grep -v "machines without a GPU"; then
    summary "FAIL: CUDA tests skipped for want of a GPU on a GPU machine (tests.txt)"
    exit 1
fi
summary "ok: CUDA tests (tests.txt)"

# 3. the synthetic benchmark on the GPU (it uses CUDA whenever torch sees a GPU)
bench() {  # name, env..., -- args...
    local name=$1
    shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    if env "${envs[@]}" "${HORA_RUN[@]}" -np 1 "$PY" examples/pytorch_synthetic_benchmark.py \
        "$@" > "$OUT/bench_$name.txt" 2>&1; then
        summary "ok: benchmark $name: $(grep -E 'Total img/sec' "$OUT/bench_$name.txt" | tail -1)"
    else
        summary "FAIL: benchmark $name (bench_$name.txt)"
        exit 1
    fi
}
ARGS=(--model resnet50 --batch-size 64 --num-iters 5)
bench hora_staged HORA_LOG_LEVEL=WARNING -- "${ARGS[@]}"
bench hora_nccl HOROVOD_GPU_OPERATIONS=NCCL -- "${ARGS[@]}"
bench ddp HORA_LOG_LEVEL=WARNING -- "${ARGS[@]}" --ddp

# 4. the lab on the GPU: allreduce of CUDA tensors against torch's NCCL (one rank per GPU;
# --np 1 on a one-GPU machine), then a short scaling run on CUDA with GPU utilisation
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if "$PY" -m hora.lab allreduce --device cuda --np "$NGPU" --sizes 4K,64K,1M,16M,256M \
    --json "$OUT/bench_allreduce_cuda.json" --csv "$OUT/bench_allreduce_cuda.csv" \
    > "$OUT/bench_allreduce_cuda.txt" 2> "$OUT/bench_allreduce_cuda.log" \
    && ! grep -q "^skipped" "$OUT/bench_allreduce_cuda.txt"; then
    summary "ok: hora bench allreduce --device cuda --np $NGPU (bench_allreduce_cuda.txt)"
else
    summary "FAIL: hora bench allreduce --device cuda (bench_allreduce_cuda.txt, .log)"
    exit 1
fi
if "$PY" -m hora.lab scaling --device cuda --model cnn,resnet50 --backends native,nccl \
    --np 1 --steps 10 --warmup 3 --out "$OUT/scaling_cuda" \
    > "$OUT/scaling_cuda.txt" 2> "$OUT/scaling_cuda.log" \
    && grep -q "GPU util mean / max" "$OUT/scaling_cuda.txt" \
    && ! grep -q "^failed" "$OUT/scaling_cuda.txt"
then
    summary "ok: hora bench scaling --device cuda (scaling_cuda.txt, scaling_cuda/)"
else
    summary "FAIL: hora bench scaling --device cuda (scaling_cuda.txt, .log)"
    exit 1
fi
summary "done: results in $OUT"
