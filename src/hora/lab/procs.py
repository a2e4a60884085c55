"""The benchmarks' worker processes: started in sessions of their own, followed, stopped.

``hora bench allreduce`` (:mod:`hora.lab.allreduce`, and across namespace hosts
:mod:`hora.lab.netns`) and ``hora bench ddp`` (:mod:`hora.lab.ddp`) share these: each worker
runs with this process's environment minus any rank identity and one compute thread, writes its
log to a file, and appends its results as JSON lines that :func:`follow` reads as they come.
Called from the bench's own thread; not thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from hora.lab import gpu, report
from hora.launch.workerenv import TORCH_HUGE_PAGES

# hora's variants: extra environment for its workers (hora-tcp: no shared memory between ranks;
# hora-shm-staged: shared memory without single-copy reads, as under Yama's ptrace_scope=1;
# the CUDA ones choose hora's backend)
HORA_VARIANTS: dict[str, dict[str, str]] = {
    "hora": {},
    "hora-tcp": {"HORA_SHM_DISABLE": "1"},
    "hora-shm-staged": {"HORA_SHM_SINGLE_COPY": "0"},
    **gpu.HORA_CUDA_VARIANTS,
}


class BackendFailed(RuntimeError):
    """A backend's workers failed or timed out; the message says which and why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_IDENTITY = re.compile(
    r"^(HORA|HOROVOD)_(RANK|SIZE|LOCAL_RANK|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|HOSTNAME|"
    r"RENDEZVOUS_ADDR|RENDEZVOUS_PORT|GLOO_RENDEZVOUS_ADDR|GLOO_RENDEZVOUS_PORT|SECRET_KEY)$"
    r"|^(OMPI_COMM_WORLD|PMIX)_|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)$"
)


def base_env() -> dict[str, str]:
    """This process's environment (knobs such as ``HORA_CPU_BIND`` included) without any rank
    identity, one compute thread per worker, and torch's huge pages as ``hora run`` gives them
    (every backend of a run shares its workers' allocator)."""
    env = {**TORCH_HUGE_PAGES, **{k: v for k, v in os.environ.items() if not _IDENTITY.match(k)}}
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1"
    )
    return env


def worker_cmd(backend: str, plan_path: str) -> list[str]:
    module = "hora.lab.gpu_workers" if backend in gpu.CUDA_BACKENDS else "hora.lab.workers"
    return [sys.executable, "-m", module, backend, plan_path]


def start(cmd: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def follow(
    procs: list[subprocess.Popen[bytes]],
    out_path: str,
    timeout: float,
    on_row: Callable[[report.Row], None],
) -> list[report.Row]:
    """Wait for the workers, passing each result line to ``on_row`` as it appears."""
    rows: list[report.Row] = []
    deadline = time.monotonic() + timeout
    offset = 0
    while True:
        finished = all(p.poll() is not None for p in procs)
        if os.path.exists(out_path):
            with open(out_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                rows.append(json.loads(line))
                on_row(rows[-1])
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed or finished:
            break
        if time.monotonic() > deadline:
            raise BackendFailed(f"timed out after {timeout:g} s")
        time.sleep(0.1)
    if failed:
        raise BackendFailed(f"worker {procs.index(failed[0])} exited with {failed[0].returncode}")
    return rows


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session, started above
        p.wait(timeout=30)


def warmup_iters(iters: int) -> int:
    """Untimed calls before ``iters`` timed ones."""
    return max(2, iters // 10)
