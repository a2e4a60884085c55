"""Where a rank's threads run: each local rank's share of the host's cores for its frameworks'
thread pools, its binding to cores (``HORA_CPU_BIND``), and its engine thread's core
(``HOROVOD_THREAD_AFFINITY``). Called by :func:`hora.core.runtime.init` and ``shutdown``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from hora.identity import Identity
from hora.settings import CPU_BIND

log = logging.getLogger("hora")


def engine_core(ident: Identity, spec: str) -> int | None:
    """The core ``HOROVOD_THREAD_AFFINITY`` (one core id per local rank, comma-separated) gives
    this rank's engine thread; None when unset. ValueError, saying what to give, otherwise."""
    if not spec.strip():
        return None
    name = "HORA_THREAD_AFFINITY / HOROVOD_THREAD_AFFINITY"
    try:
        cores = [int(c) for c in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"{name}={spec!r}: expected core ids separated by commas, one per local rank"
        ) from None
    if len(cores) < ident.local_size:
        raise ValueError(
            f"{name}={spec!r} names {len(cores)} core(s) for {ident.local_size} local ranks: "
            "give one core id per local rank"
        )
    core, count = cores[ident.local_rank], os.cpu_count() or 1
    if not 0 <= core < count or not hasattr(os, "sched_setaffinity"):
        raise ValueError(
            f"{name}={spec!r}: local rank {ident.local_rank} cannot run on core {core}; "
            f"this host has cores 0-{count - 1}"
        )
    return core


# Framework bindings that run intra-op thread pools (hora.torch) register a hook here: called
# at init() with this rank's share of the host's cores, it gives its pool that share when the
# user chose no thread count, and returns the number of threads the pool runs and whether it
# set that number itself.
ThreadHook = Callable[[int], tuple[int, bool]]
_thread_hooks: list[ThreadHook] = []
_unbound: set[int] | None = None  # the process's cores before init() bound it (to rebind)
# whether children forked from now on get _unbound back (the rank was bound as "crowded")
_children_unbound = False
_said_threads = False  # the thread share was said (local rank 0, once per process)


def register_thread_hook(hook: ThreadHook) -> None:
    """Let ``hook(share)`` size a framework's thread pool at every ``init()`` (idempotent)."""
    if hook not in _thread_hooks:
        _thread_hooks.append(hook)


def host_cores() -> list[int] | None:
    """The cores this process may run on before hora bound it; None where it cannot tell, or
    where something else (mpirun, Slurm, taskset, the user) restricted it already."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    if _unbound is not None:
        return sorted(_unbound)
    avail = sorted(os.sched_getaffinity(0))
    return avail if len(avail) == os.cpu_count() else None


def core_each(ident: Identity, cores: list[int] | None) -> bool:
    """Whether this host has a core for each of its ranks (``cores``: from :func:`host_cores`;
    None: bound already, and then only the cores it was bound to count)."""
    if cores is None and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    n = len(cores) if cores is not None else (os.cpu_count() or 1)
    return n >= ident.local_size


def share_threads(ident: Identity, cores: list[int] | None) -> int | None:
    """Give each local rank's thread pools its share of the host's cores when the user set no
    ``OMP_NUM_THREADS`` (torchrun sets it to 1; a share uses the cores a host has to spare),
    said once per host at log level info (``HOROVOD_LOG_LEVEL=info`` shows it). Returns the
    most threads any registered pool runs, None when no pool is registered."""
    global _said_threads
    if cores:
        share = max(1, len(cores) // ident.local_size)
    elif hasattr(os, "sched_getaffinity"):  # bound already (mpirun, Slurm): its cores are its share
        share = len(os.sched_getaffinity(0))
    else:
        share = max(1, (os.cpu_count() or 1) // ident.local_size)
    answers = [hook(share) for hook in _thread_hooks]
    if any(set_here for _, set_here in answers) and ident.local_rank == 0 \
            and ident.local_size > 1 and not _said_threads:  # fmt: skip
        _said_threads = True
        # information, not a warning: hora chose the share and nothing needs fixing
        log.info(
            "OMP_NUM_THREADS is not set: each of the %d ranks on this host runs %d intra-op "
            "thread(s), its share of %s. Set OMP_NUM_THREADS (or call torch.set_num_threads() "
            "before hvd.init()) to choose.", ident.local_size, share,
            f"{len(cores)} cores" if cores else "its cores",
        )
    return max(n for n, _ in answers) if answers else None


def bind_cpus(ident: Identity, mode: str, cores: list[int] | None,
               threads: int | None) -> None:  # fmt: skip
    """Bind this rank to cores as ``HORA_CPU_BIND`` says, where its threads fit them.

    ``crowded`` (the default) binds only on a host with more local ranks than cores: each rank
    one core, the cores dealt out in turn (local rank ``i`` on core ``i % cores``). Left to
    itself, the kernel runs three ranks on one core and one on the other for hundreds of
    milliseconds at a time (a rank that ran a moment ago counts as cache-hot, and a woken rank
    goes beside its waker): the lone rank's core then waits for the three, every round.
    ``auto`` binds on any host: with a core or more per rank, each local rank its own slice
    (``cores // local_size`` of them). ``none`` never binds.

    A rank is bound only when its thread pools fit its slice: every registered pool
    (``threads``, from :func:`share_threads`) or, with none registered, the
    ``OMP_NUM_THREADS`` the process runs with, is at most the slice's size. A rank whose pools
    are larger than its slice would time-share its cores (measured on a two-core host: a CNN's
    step up to ten times slower, docs/settings.md), so it is left unbound. Binding keeps each
    rank's threads, and the DataLoader workers and other processes it starts afterwards, on
    its own cores, but it also keeps them from moving to a core that other work leaves idle,
    which made training steps slower on a shared host with a core per rank
    (docs/settings.md): so ``auto`` is opt-in there. Only done when nothing (mpirun, Slurm,
    taskset, the user) bound the process already; an elastic job's later rounds bind again
    from the cores the process had at first.
    """
    global _unbound, _children_unbound
    mode = mode.lower()
    if mode not in CPU_BIND:
        raise ValueError(
            f"HORA_CPU_BIND={mode!r} (or HOROVOD_CPU_BIND, hora run --cpu-bind): give "
            "'crowded' (the default: one core each where ranks outnumber cores, else no "
            "binding), 'none' (no binding) or 'auto' (each local rank its own slice of "
            "cores, where its threads fit the slice)"
        )
    if not cores:
        return
    crowded = len(cores) < ident.local_size
    per = 1 if crowded else len(cores) // ident.local_size
    if threads is None:
        omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        threads = int(omp) if omp.isdigit() else None
    fits = threads is not None and threads <= per
    binds = mode == "auto" or (mode == "crowded" and crowded)
    if not binds or ident.local_size <= 1 or not fits:
        slice_ = set(cores)  # unbound (again, after an earlier round bound it)
    elif crowded:
        slice_ = {cores[ident.local_rank % len(cores)]}
    else:
        slice_ = set(cores[ident.local_rank * per:(ident.local_rank + 1) * per])
    if _unbound is None and slice_ == set(cores):
        return  # never bound, nothing to undo
    if _unbound is None:
        _unbound = set(cores)
    _set_cpus(slice_)
    _children_unbound = mode == "crowded"
    log.debug("local rank %d runs on cores %s", ident.local_rank, sorted(slice_))


def _set_cpus(cores: set[int]) -> None:
    """Every thread of this process on ``cores``."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def unbind_cpus() -> None:
    """At shutdown: the cores the process had before :func:`bind_cpus` bound it, back (a
    process that goes on after hora, a Spark or Ray worker reused for other work, runs as it
    did before; a later ``init()`` binds again)."""
    global _unbound, _children_unbound
    if _unbound is not None:
        _set_cpus(_unbound)
        _unbound, _children_unbound = None, False


def _unbind_child() -> None:
    """In a child forked from a rank bound because ranks outnumber cores (a DataLoader
    worker): every core the rank had before, since the binding is for the ranks' own turns."""
    if _children_unbound and _unbound is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, _unbound)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unbind_child)
