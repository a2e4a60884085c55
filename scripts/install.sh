#!/usr/bin/env bash
# Installs hora and everything its tests and examples use, on a fresh Debian-like machine.
# Safe to run again: every step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: Open MPI (for the MPI backend and mpirun tests) and a C compiler to build
# mpi4py against it, sshd (multi-host tests), iproute2 (network namespaces). Only as root and
# only what is missing. The container recipes in deploy/ run this script too.
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin libopenmpi-dev)
command -v cc >/dev/null || need+=(gcc libc6-dev)
[ -x /usr/sbin/sshd ] || need+=(openssh-server openssh-client)
command -v ip >/dev/null || need+=(iproute2)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)  # pyspark (hora.spark)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "hora: installing system packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "hora: missing ${need[*]} (not root or no apt-get): the tests that need them skip"
  fi
fi

PY=${PYTHON:-python3}
# torch first and pinned: any other version would pull gigabytes of CUDA packages.
# HORA_TORCH_INDEX_URL picks torch's wheel index (deploy/Dockerfile.cpu: the CPU-only wheels;
# unset: the default index, whose Linux wheels carry CUDA and NCCL).
torch_index=()
[ -n "${HORA_TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$HORA_TORCH_INDEX_URL")
$PY -m pip install -q "${torch_index[@]}" "torch==2.13.0"
# TensorFlow (CPU build; tf-keras for the Keras 2 world) for hora.tensorflow and its tests.
extras="torch,lab,bf16,tensorflow,dev"
extras="$extras,spark"  # pyspark, for hora.spark and its tests
command -v mpicc >/dev/null && extras="$extras,mpi"
extras="$extras,ray"  # hora.ray and its tests (Ray 2.60; leaves numpy and torch as they are)
$PY -m pip install -q -e ".[${extras}]"
