"""Start real hora ranks as separate processes, with hard timeouts.

``run_ranks(fn, np)`` starts a rendezvous server in the test process, spawns ``np`` Python
processes with the environment ``hora run`` would give them, runs ``fn(rank, *args)`` in each
(``fn`` travels by value with cloudpickle, so closures work) and returns the per-rank results.
Any rank that fails, or a run that exceeds ``timeout``, fails the test with every rank's
stderr; all processes are killed on the way out, whatever happens.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from hora.rendezvous.server import RendezvousServer

_WORKER = r"""
import os, pickle, sys, traceback
import cloudpickle
path = sys.argv[1]
rank = int(os.environ["HORA_RANK"])
with open(path + ".fn", "rb") as f:
    fn, args = cloudpickle.load(f)
try:
    out = ("ok", fn(rank, *args))
except BaseException as e:
    out = ("error", f"{type(e).__name__}: {e}\n" + traceback.format_exc())
try:
    data = pickle.dumps(out)
except Exception as e:
    data = pickle.dumps(("error", f"result not picklable: {e}"))
with open(f"{path}.{rank}", "wb") as f:
    f.write(data)
sys.stdout.flush()
os._exit(0 if out[0] == "ok" else 1)
"""


@dataclass
class RankResult:
    rank: int
    status: str  # ok, error, died (no result file), timeout
    value: Any
    returncode: int | None
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def spawn_ranks(
    fn: Callable[..., Any],
    np: int,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    local_size: int | None = None,
) -> list[RankResult]:
    mod = sys.modules.get(fn.__module__)
    if mod is not None and fn.__module__ not in ("__main__",) and "hora" not in fn.__module__:
        cloudpickle.register_pickle_by_value(mod)
    secret = secrets.token_bytes(32)
    server = RendezvousServer(secret, host="127.0.0.1")
    port = server.start()
    tmp = tempfile.mkdtemp(prefix="hora-test-")
    path = os.path.join(tmp, "job")
    with open(path + ".fn", "wb") as f:
        cloudpickle.dump((fn, args), f)
    local_size = np if local_size is None else local_size
    procs: list[subprocess.Popen[bytes]] = []
    errs = []
    try:
        for r in range(np):
            e = dict(os.environ)
            e.update(
                {
                    "HORA_RANK": str(r),
                    "HORA_SIZE": str(np),
                    "HORA_LOCAL_RANK": str(r % local_size),
                    "HORA_LOCAL_SIZE": str(local_size),
                    "HORA_CROSS_RANK": str(r // local_size),
                    "HORA_CROSS_SIZE": str((np + local_size - 1) // local_size),
                    "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
                    "HORA_RENDEZVOUS_PORT": str(port),
                    "HORA_SECRET_KEY": secret.hex(),
                    "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1",
                    # a test that hangs fails fast, naming the missing ranks
                    "HORA_STALL_CHECK_TIME_SECONDS": "10",
                    "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30",
                }
            )
            e.update(env or {})
            # the tests' shared helpers (cuda_fakes, ...) import in the ranks as here
            e["PYTHONPATH"] = os.pathsep.join(
                p for p in (e.get("PYTHONPATH"), os.path.dirname(os.path.abspath(__file__))) if p
            )
            err = open(f"{path}.{r}.stderr", "wb")  # noqa: SIM115 - closed below
            errs.append(err)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER, path],
                    env=e,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            left = deadline - time.monotonic()
            try:
                p.wait(max(left, 0.01))
            except subprocess.TimeoutExpired:
                break
    finally:
        timed_out = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for err in errs:
            err.close()
        server.stop()
    try:
        return [_result(path, r, p.returncode, timed_out[r]) for r, p in enumerate(procs)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _result(path: str, rank: int, returncode: int | None, timed_out: bool) -> RankResult:
    with open(f"{path}.{rank}.stderr", "rb") as f:
        stderr = f.read().decode(errors="replace")
    if timed_out:
        return RankResult(rank, "timeout", None, None, stderr)
    try:
        with open(f"{path}.{rank}", "rb") as f:
            status, value = pickle.load(f)
    except FileNotFoundError:
        status, value = "died", None
    return RankResult(rank, status, value, returncode, stderr)


def run_ranks(
    fn: Callable[..., Any],
    np: int,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    local_size: int | None = None,
) -> list[Any]:
    """Like :func:`spawn_ranks`, but every rank must succeed; returns their values."""
    results = spawn_ranks(fn, np, args, timeout, env, local_size)
    bad = [r for r in results if not r.ok]
    if bad:
        lines = [
            f"rank {r.rank}: {r.status} (exit {r.returncode})\n{r.value or ''}\n"
            f"stderr:\n{r.stderr[-3000:]}"
            for r in bad
        ]
        raise AssertionError("ranks failed:\n" + "\n".join(lines))
    return [r.value for r in results]


def run_checks(checks: dict[str, Callable[..., None]], *args: Any) -> dict[str, str]:
    """Every check called with ``args`` in turn: ``"ok"`` or its traceback, by name (one that
    fails does not stop the others). For a battery of checks run in one spawn of ranks."""
    import traceback

    out = {}
    for name, check in checks.items():
        try:
            check(*args)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; a zombie counts as gone. The process may vanish
    between any two steps here, so each step treats that as gone rather than raising."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
