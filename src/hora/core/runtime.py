"""init, shutdown, topology and process sets: one :class:`Runtime` per ``init()``.

``init`` reads the identity and settings (validated as the launcher validates them: a bad
value raises ValueError naming the variable; rank 0 checks that its timeline and autotune log
can be written), connects to the rendezvous store (starting it on
rank 0 when the environment says this rank hosts it), builds the transport, the backend and the
engine, registers the process sets, and installs an ``atexit`` shutdown. ``shutdown`` stops the
engine; ``init`` may be called again afterwards (a new generation of connections).
:func:`register_process_set` and :func:`remove_process_set` negotiate a set with every rank
through a control op (:func:`control`); the op surface's ``add_process_set`` and
``remove_process_set`` call them. Called from user threads; init and shutdown are guarded by
one lock.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from hora.backends import registry as backends
from hora.backends.registry import BackendContext
from hora.core.engine import Engine
from hora.core.executor import TensorEntry
from hora.core.handles import Handle, in_flight
from hora.core.messages import OpType, Request
from hora.core.process_sets import (
    DUPLICATE_SET,
    ProcessSet,
    duplicate_error,
    global_process_set,
    registered_with,
)
from hora.errors import NOT_INITIALIZED_MESSAGE, MismatchError
from hora.identity import Identity, detect
from hora.rendezvous.rounds import WorkerRemoved, is_elastic_worker, join
from hora.settings import CPU_BIND, Settings, check_paths, env_lookup, load

log = logging.getLogger("hora")

# Where each local rank has a core, a caller that runs its own direct-mode round (it waits for
# its op anyway) polls for the other members' headers this long before it sleeps. On a 2-core
# VM a round trip over a local socket took 70 us with both ends sleeping in poll and 7 us with
# both polling: a wake-up costs more than the wait it ends.
ROUND_SPIN_S = 100e-6
# Where ranks outnumber the cores, such a caller polls this long, giving its core to any other
# runnable thread between polls (sched_yield), as Open MPI does when oversubscribed: a rank
# that sleeps hands its core back only through a wake-up, and a round waits on every member's.
# np=4 on 2 cores, a blocking 4 KiB allreduce: 0.95-1.03 ms sleeping, 0.59-0.65 ms yielding.
SHARED_SPIN_S = 1e-3


class Runtime:
    def __init__(self, identity: Identity, settings: Settings, generation: int | str,
                 mpi_job: Any = None) -> None:
        self.identity = identity
        self.settings = settings
        self.server: Any = None if mpi_job is None else mpi_job.server
        self.store: Any = None
        self.prefix = f"hora/{generation}"  # the job's keys in the store, this generation's
        self.p2p: Any = None  # point-to-point messages (core/p2p.py), made on first use
        transport = None
        if not identity.is_single:
            transport = self._connect(identity, settings, generation)
        self.timeline: Any = None
        path = timeline_path(settings.timeline, identity.rank)
        if path and settings.timeline != "DYNAMIC":
            self.timeline = make_timeline(path, settings, identity.rank, identity.size)
        ctx = BackendContext(identity, settings, self.store, transport, f"hora/{generation}",
                             None if mpi_job is None else mpi_job.comm)
        self.backend_name = backends.select(settings)
        backend = backends.create(self.backend_name, ctx)
        self.engine = Engine(identity.rank, identity.size, settings, transport, backend,
                             self.timeline)
        self.engine.register_global_set()
        self.engine.departure = self._departure
        try:
            self.engine.start()
        except BaseException:
            # a peer was lost while connecting: close this rank's connections, or the peers
            # already connected to it would wait on it for ever (an elastic job re-forms)
            if transport is not None:
                transport.close()
            if self.store is not None:
                self.store.close()
            raise
        self.sets: dict[int, ProcessSet] = {0: global_process_set}
        self.dynamic_counter = 0
        self.auto_names: dict[int, int] = {}  # set id -> unnamed ops so far (every kind)

    def _connect(self, ident: Identity, settings: Settings, generation: int | str) -> Any:
        from hora.rendezvous.client import StoreClient
        from hora.transport.tcp import TcpTransport

        if ident.secret is None:
            raise ValueError("HORA_SECRET_KEY is not set: start the job with `hora run`, which "
                             "creates a per-job secret, or set HORA_SECRET_KEY (hex) on every "
                             "rank")
        assert ident.rendezvous_addr is not None and ident.rendezvous_port is not None
        if ident.host_store and ident.rank == 0:
            from hora.rendezvous.server import RendezvousServer

            bind = _store_bind(ident.rendezvous_addr, settings.listen_any)
            self.server = RendezvousServer(ident.secret, host=bind, port=ident.rendezvous_port,
                                           handshake_timeout=settings.handshake_timeout_seconds)
            try:
                self.server.start()
            except OSError as e:
                if bind == "0.0.0.0":
                    raise
                log.warning("the rendezvous store cannot listen on %s (%s); it listens on "
                            "every interface instead", bind, e)
                self.server = RendezvousServer(ident.secret, host="0.0.0.0",
                                               port=ident.rendezvous_port,
                                               handshake_timeout=settings.handshake_timeout_seconds)
                self.server.start()
        timeout = settings.gloo_timeout_seconds
        self.store = StoreClient(ident.rendezvous_addr, ident.rendezvous_port, ident.secret,
                                 timeout=timeout)
        tcp = TcpTransport(ident.rank, ident.size, ident.secret, self.store,
                           prefix=f"hora/{generation}", iface=settings.gloo_iface,
                           connect_timeout=timeout,
                           handshake_timeout=settings.handshake_timeout_seconds,
                           listen_any=settings.listen_any)
        from hora.transport.composite import host_transport

        return host_transport(tcp, self.store, f"hora/{generation}", ident.secret,
                              ident.hostname, settings.shm_disable, timeout,
                              single_copy=settings.shm_single_copy)

    def _departure(self, rank: int, wait: float) -> str | None:
        """How ``rank`` left, as the launcher recorded it ("exited with code 0"), waiting up to
        ``wait`` seconds for it; None where no launcher records exits (engine or user thread)."""
        from hora.rendezvous.protocol import DEPARTURES_REPORTED, departure_key

        if self.store is None or not self.store.check([DEPARTURES_REPORTED]):
            return None
        return str(self.store.get(departure_key(rank), timeout=wait).decode())

    def close(self, how: str | None = None) -> None:
        self.engine.shutdown(how=how)
        if self.p2p is not None:
            self.p2p.close(self.engine.cause or how or "")
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.stop()


def timeline_path(path: str, rank: int) -> str:
    """Where ``rank`` writes its timeline: ``{rank}`` in ``path`` names one file per rank (every
    rank records); without it only rank 0 writes ``path``, as Horovod does. "" for none."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else ""


def _store_bind(addr: str, listen_any: bool) -> str:
    """Where rank 0 runs the store when the environment names its address ``addr``: that
    address (loopback for a local job), or every interface when asked (``HORA_LISTEN_ANY``) or
    when ``addr`` is a host name that resolves to loopback here but not on the other hosts."""
    if listen_any:
        return "0.0.0.0"
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return "0.0.0.0"
    named = addr != ip and addr != "localhost"
    if ip.startswith("127.") and named:
        return "0.0.0.0"
    return ip


def make_timeline(path: str, settings: Settings, rank: int, size: int) -> Any:
    from hora.core.timeline import Timeline

    meta = {
        "rank": rank,
        "size": size,
        "fusion_threshold_bytes": settings.fusion_threshold,
        "cycle_time_ms": settings.cycle_time_ms,
    }
    return Timeline(path, mark_cycles=settings.timeline_mark_cycles, meta=meta)


_lock = threading.RLock()
_runtime: Runtime | None = None
_generation = 0
_elastic_round = -1  # the last elastic round this process joined
_atexit_registered = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hora on this process. Idempotent while initialized."""
    global _runtime, _generation, _atexit_registered, _elastic_round
    with _lock:
        running = _runtime is not None and _runtime.engine.running
    if running:  # Horovod binds the sets given again to those registered (and adds new ones)
        _register_static(None if process_sets == "dynamic" else process_sets)
        return
    with _lock:
        if _runtime is not None and _runtime.engine.running:
            return
        if _runtime is not None:  # the engine died: clean up before starting again
            shutdown()
        settings = load()
        if process_sets == "dynamic":
            settings = settings.replace(dynamic_process_sets=True)
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
            process_sets = None
        generation: int | str = _generation
        if settings.elastic and is_elastic_worker(os.environ):
            # the launcher assigns the rank; each round has its own connections
            try:
                timeout = settings.elastic_timeout
                identity, _elastic_round = join(os.environ, _elastic_round, timeout)
            except WorkerRemoved as e:
                if _elastic_round >= 0:
                    raise  # a re-formation: hora.elastic.run exits with status 0
                log.warning("%s before it joined; exiting with status 0", e)
                raise SystemExit(0) from None
            generation, mpi_job = f"e{_elastic_round}", None
        else:
            identity, mpi_job = _mpi_world(comm, detect(), settings)
        if identity.rank == 0:  # the files rank 0 writes (the launcher checked them already)
            check_paths(settings)
        _configure_logging(settings)
        cores = _cores()
        _bind_cpus(identity, settings.cpu_bind, cores, _share_threads(identity, cores))
        core = engine_core(identity, settings.thread_affinity)
        try:
            _runtime = Runtime(identity, settings, generation, mpi_job)
        except Exception as e:
            if mpi_job is not None and mpi_job.server is not None:
                mpi_job.server.stop()
            raise ValueError(f"Horovod initialization failed: {e}") from e
        if _core_each(identity, cores):
            _runtime.engine.spin_s = ROUND_SPIN_S
        else:
            _runtime.engine.spin_s, _runtime.engine.spin_yield = SHARED_SPIN_S, True
        if core is not None:
            try:
                os.sched_setaffinity(_runtime.engine.thread_id, {core})
            except OSError as e:
                shutdown()
                raise ValueError(f"cannot pin the engine thread to core {core}: {e}") from e
            log.debug("engine thread of local rank %d pinned to core %d", identity.local_rank, core)
        _generation += 1
        global_process_set.ranks = list(range(identity.size))
        global_process_set._bind(0, identity.rank)
        if not _atexit_registered:
            atexit.register(_at_exit)
            if sys.excepthook is sys.__excepthook__:
                sys.excepthook = _note_uncaught
            _atexit_registered = True
    _register_static(process_sets)


def _register_static(process_sets: Any) -> None:
    """Register ``init``'s ``process_sets`` in order, as Horovod does: an entry with the ranks
    of the global set or of an earlier entry is a duplicate, left unregistered, and ValueError
    names it once the others are registered; one with the ranks of a set registered before
    this call is bound to that set."""
    rt = runtime()
    seen, duplicates = {tuple(global_process_set.ranks)}, []
    for i, ps in enumerate(process_sets or ()):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must hold hvd.ProcessSet objects, got {ps!r}")
        if tuple(ps.ranks) in seen:
            ps._unbind()
            duplicates.append(f"entry number {i} ({ps.ranks})")
            continue
        seen.add(tuple(ps.ranks))
        known = registered_with(ps.ranks, rt.sets)
        if known is not None:
            ps._bind(known, rt.identity.rank)
        else:
            register_process_set(ps)
    if duplicates:
        raise ValueError(
            f"process_sets {', '.join(duplicates)} duplicates the global set or an earlier "
            "entry; hora is initialized with the other sets: pass each set of ranks once"
        )


def _mpi_world(comm: Any, identity: Identity, settings: Settings) -> tuple[Identity, Any]:
    """hora's world from MPI where no `hora run` store exists: ``init(comm=...)`` (an mpi4py
    communicator or ``COMM_WORLD`` ranks), or the MPI backend under a plain ``mpirun``. Rank 0
    of the communicator starts the store and broadcasts its address and a fresh secret."""
    if comm is not None and identity.source == "hora" and identity.size > 1:
        raise ValueError(
            "init(comm=...) needs a job started by MPI (`hora run --mpi` or mpirun); under "
            f"`hora run` without --mpi each of the {identity.size} processes is an MPI world of "
            "its own"
        )
    plain_mpirun = identity.source == "mpi" and not env_lookup(os.environ, "RENDEZVOUS_ADDR")
    if comm is None and not (plain_mpirun and backends.select(settings) == "mpi"):
        return identity, None
    from hora.backends.mpi import bootstrap

    job = bootstrap(comm, settings.gloo_iface, identity.hostname, settings.listen_any)
    return job.identity, job


def control(
    kind: OpType, name: str, process_set_id: int = 0, ranks: tuple[int, ...] | None = None
) -> Handle:
    """Submit one control op (barrier, join, adding or removing a process set) on a set;
    its handle completes with the op's result. ValueError when ``name`` is in flight. Every
    caller waits for the handle, so a set in direct mode may run it in the calling thread."""
    rt = runtime()
    req = Request(kind, name, ranks=ranks)
    key = (process_set_id, req.match)
    in_flight.claim([key], [kind.name.lower()])
    handle = Handle()

    def done(value: Any) -> None:
        in_flight.release(key)
        handle.set_result(value)

    def failed(error: BaseException) -> None:
        in_flight.release(key)
        handle.set_error(error)

    rt.engine.enqueue(process_set_id, [TensorEntry(req, None, None, done, failed)], inline=True)
    return handle


def register_process_set(ps: ProcessSet) -> ProcessSet:
    """Negotiate ``ps`` with every rank (all must register the same sets in the same order)."""
    rt = runtime()
    if any(r >= rt.identity.size for r in ps.ranks) or not ps.ranks:
        raise ValueError(
            f"process set ranks {ps.ranks} must be a non-empty subset of 0..{rt.identity.size - 1}"
        )
    rt.dynamic_counter += 1
    name = f"process_set.add.{rt.dynamic_counter}"
    # Negotiated even when the ranks are registered already, so that every rank fails alike:
    # a duplicate on every rank raises the ValueError below on every rank; ranks asking for
    # different sets all get the coordinator's "Mismatched process set registration".
    try:
        ps_id = int(control(OpType.ADD_PROCESS_SET, name, 0, tuple(ps.ranks)).wait())
    except MismatchError as e:
        known = registered_with(ps.ranks, rt.sets)  # the same on every rank
        if known is not None and str(e).startswith(DUPLICATE_SET):
            raise duplicate_error(ps, rt.sets[known]) from None
        raise
    ps._bind(ps_id, rt.identity.rank)
    rt.sets[ps_id] = ps
    return ps


def remove_process_set(ps: ProcessSet) -> bool:
    """Remove a registered set on every rank; False when ``ps`` is not one (or is global)."""
    rt = runtime()
    ps_id = ps.process_set_id
    if ps_id is None or ps_id == 0 or ps_id not in rt.sets:
        return False
    rt.dynamic_counter += 1
    name = f"process_set.remove.{rt.dynamic_counter}"
    control(OpType.REMOVE_PROCESS_SET, name, 0, tuple(ps.ranks)).wait()
    del rt.sets[ps_id]
    ps._unbind()
    return True


def shutdown(how: str | None = "called hvd.shutdown()") -> None:
    """Stop hora on this process; ``how`` tells the other ranks why (see _at_exit)."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
        if rt is None:
            return
        for ps in rt.sets.values():
            if ps is not global_process_set:
                ps._unbind()
        rt.close(how)
        _unbind_cpus()


_uncaught: str | None = None  # "raised X: message" once an exception ends the main thread


def _note_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """sys.excepthook: remember the exception for the goodbye, then report it as before."""
    global _uncaught
    if not issubclass(kind, KeyboardInterrupt):
        _uncaught = f"raised {kind.__name__}: {value}"
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook


def _at_exit() -> None:
    """The interpreter exits: say why, if an uncaught exception is the reason; otherwise the
    launcher reports the exit status to the ranks that ask."""
    shutdown(_uncaught)


def runtime() -> Runtime:
    rt = _runtime
    if rt is None:
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    return rt


def elastic_round() -> int:
    """The elastic round this process joined last (-1: none, or not an elastic worker)."""
    return _elastic_round


def is_initialized() -> bool:
    return _runtime is not None


def current() -> Runtime | None:
    """The runtime, None before ``init()`` and after ``shutdown()`` (a hot path's one call)."""
    return _runtime


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


def _cores() -> list[int] | None:
    """The cores this process may run on before hora bound it; None where it cannot tell, or
    where something else (mpirun, Slurm, taskset, the user) restricted it already."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    if _unbound is not None:
        return sorted(_unbound)
    avail = sorted(os.sched_getaffinity(0))
    return avail if len(avail) == os.cpu_count() else None


def _core_each(ident: Identity, cores: list[int] | None) -> bool:
    """Whether this host has a core for each of its ranks (``cores``: from :func:`_cores`;
    None: bound already, and then only the cores it was bound to count)."""
    if cores is None and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    n = len(cores) if cores is not None else (os.cpu_count() or 1)
    return n >= ident.local_size


def _share_threads(ident: Identity, cores: list[int] | None) -> int | None:
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


def _bind_cpus(ident: Identity, mode: str, cores: list[int] | None,
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
    (``threads``, from :func:`_share_threads`) or, with none registered, the
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


def _unbind_cpus() -> None:
    """At shutdown: the cores the process had before :func:`_bind_cpus` bound it, back (a
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


def _tag_rank(record: logging.LogRecord) -> bool:
    """The rank at the time of the record (an elastic job's ranks change with its rounds)."""
    record.hora_rank = os.environ.get("HORA_RANK", os.environ.get("HOROVOD_RANK", "0"))
    return True


def _configure_logging(settings: Settings) -> None:
    level = settings.log_level.upper()
    level = {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(level, level)
    logger = logging.getLogger("hora")
    logger.setLevel(getattr(logging, level, logging.WARNING))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_tag_rank)
        fmt = "[hora rank %(hora_rank)s] %(levelname)s %(name)s: %(message)s"
        if not settings.log_hide_time:
            fmt = "%(asctime)s " + fmt
        handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(handler)
        logger.propagate = False
