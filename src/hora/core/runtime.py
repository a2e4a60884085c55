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
import logging
import os
import socket
import sys
import threading
from typing import Any

from hora.backends import registry as backends
from hora.backends.registry import BackendContext
from hora.core.engine import Engine
from hora.core.executor import TensorEntry
from hora.core.handles import Handle, in_flight
from hora.core.messages import OpType, Request
from hora.core.placement import (
    bind_cpus,
    core_each,
    engine_core,
    host_cores,
    share_threads,
    unbind_cpus,
)
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
from hora.settings import Settings, check_paths, env_lookup, load

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
        cores = host_cores()
        bind_cpus(identity, settings.cpu_bind, cores, share_threads(identity, cores))
        core = engine_core(identity, settings.thread_affinity)
        try:
            _runtime = Runtime(identity, settings, generation, mpi_job)
        except Exception as e:
            if mpi_job is not None and mpi_job.server is not None:
                mpi_job.server.stop()
            raise ValueError(f"Horovod initialization failed: {e}") from e
        if core_each(identity, cores):
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
        unbind_cpus()


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
