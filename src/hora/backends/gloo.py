"""The Gloo backend: the engine's collectives through torch.distributed's Gloo process groups.

hora still negotiates over its own control plane; only the data of each negotiated collective
moves through Gloo. Each process set gets its own ``ProcessGroupGloo``, made by the set's
members when the engine registers the set. Gloo meets its peers through hora's own
(authenticated) rendezvous store, adapted as a ``torch.distributed.Store``: there is no second
rendezvous to configure, and torch's default process group is left alone for the user.

Buffers are shared with torch tensors, never copied: bfloat16 storage is viewed as
``torch.bfloat16``; bool reduces as uint8 with MAX (or) and MIN (and). Gloo cannot reduce
int16 or uint16, and Adasum is not a Gloo collective: those run hora's own algorithms over
hora's transport. Data that is only moved (gathers, broadcasts, all-to-all) travels as bytes.
Gloo gathers equal pieces only, so an uneven allgather pads every piece to the largest.

Threads: the constructor and the global set's registration run in the user thread during
``init``; every other method runs on the engine thread only. Gloo's own threads do the work
while the engine thread waits; its busy-polling TCP loop threads run at the lowest priority
(see ``_lower_loop_priority``). Not thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hora.backends.base import SetComm
from hora.backends.registry import BackendContext
from hora.collectives import registry
from hora.collectives.reduce_ops import MAX, MIN, PRODUCT, SUM

log = logging.getLogger("hora.backends.gloo")

# what Gloo reduces itself (bool as uint8); int16 and uint16 it cannot
_GLOO_REDUCES = frozenset(
    {"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"}
)
_OPS: dict[int, Any] = {
    SUM: dist.ReduceOp.SUM,
    MIN: dist.ReduceOp.MIN,
    MAX: dist.ReduceOp.MAX,
    PRODUCT: dist.ReduceOp.PRODUCT,
}
_BOOL_OPS: dict[int, Any] = {  # on 0/1 bytes: MAX is or, MIN is and
    SUM: dist.ReduceOp.MAX,
    MAX: dist.ReduceOp.MAX,
    MIN: dist.ReduceOp.MIN,
    PRODUCT: dist.ReduceOp.MIN,
}


_TASKS = "/proc/self/task"


def _thread_names() -> dict[int, str]:
    """Every thread of this process: its id and name (empty without /proc)."""
    names = {}
    for tid in os.listdir(_TASKS) if os.path.isdir(_TASKS) else []:
        # OSError: a thread that ended meanwhile
        with contextlib.suppress(OSError), open(f"{_TASKS}/{tid}/comm") as f:
            names[int(tid)] = f.read().strip()
    return names


def _lower_loop_priority(before: set[int], wait: float = 1.0) -> None:
    """Give Gloo's TCP loop threads the lowest priority (nice 19).

    The loop thread polls its sockets busily while a collective is in flight. hora binds each
    local rank to its own slice of cores, so on a small host the loop shares one core with
    Gloo's workers and the engine thread and delays each of their wake-ups by a scheduler tick.
    At nice 19 the others run first and the loop still gets every idle cycle: at np 2 on 2
    cores a 4 KiB allreduce through hora went from about 2-3 ms to 0.5 ms, 64 MiB from 42 to
    26-30 ms. Linux only; elsewhere, or without /proc, nothing changes.

    Gloo's threads name themselves once running, so a thread started by the group just made
    may still carry its creator's name: the threads not in ``before`` are waited for (up to
    ``wait`` seconds) until each has a name of its own.
    """
    if not hasattr(os, "setpriority"):
        return
    names = _thread_names()
    inherited = names.get(threading.get_native_id())
    deadline = time.monotonic() + wait
    while any(names[t] == inherited for t in names.keys() - before) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.001)
        names = _thread_names()
    for tid, name in names.items():
        if name == "gloo_tcp_loop":
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, 19)


class StoreAdapter(dist.Store):
    """hora's rendezvous store seen by torch.distributed, under a key prefix.

    Called by torch in the thread that creates a group and, later, wherever the group needs it:
    NCCL at its first collective and from its watchdog thread, Gloo at its first op under
    ``TORCH_GLOO_LAZY_INIT=1``. The group holds only the C++ half of this object, so whoever
    hands one to a group must keep the Python object as long as the group lives (the backends
    do: :meth:`GlooBackend._store`); once collected, its methods are gone and the group's next
    use of it fails with "Tried to call pure virtual function ::c10d::Store::...".
    """

    def __init__(self, client: Any, prefix: str) -> None:
        super().__init__()
        self._client, self._prefix = client, prefix

    def set(self, key: str, value: str | bytes) -> None:
        self._client.set(self._prefix + key, value.encode() if isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return bytes(self._client.get(self._prefix + key))

    def add(self, key: str, delta: int) -> int:
        return int(self._client.add(self._prefix + key, delta))

    def check(self, keys: list[str]) -> bool:
        return bool(self._client.check([self._prefix + k for k in keys]))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = None if timeout is None else timeout.total_seconds()
        self._client.wait([self._prefix + k for k in keys], seconds)


class GlooBackend:
    name = "GLOO"

    def __init__(self, ctx: BackendContext) -> None:
        if not dist.is_available() or not dist.is_gloo_available():
            raise ValueError(
                "the Gloo backend needs torch.distributed with Gloo; this PyTorch "
                "build has none (install the official wheel: pip install "
                "'hora[torch]'), or choose HOROVOD_CPU_OPERATIONS=native"
            )
        self._rank = ctx.identity.rank
        self._client, self._prefix = ctx.store, ctx.prefix
        self._host = "127.0.0.1"
        if ctx.store is not None:
            from hora.transport.tcp.transport import advertise_address

            self._host = advertise_address(ctx.settings.gloo_iface, ctx.store.host)
        self._timeout = timedelta(seconds=ctx.settings.gloo_timeout_seconds)
        self._groups: dict[int, Any] = {}
        self._registered = 0  # sets registered so far: the same count on every rank
        self._keys: dict[int, str] = {}  # each set's store prefix
        # every store handed to a group of each set, held as long as the set's groups live
        self._stores: dict[int, list[Any]] = {}

    # -- process sets -----------------------------------------------------------------------
    def add_process_set(self, ps_id: int, ranks: list[int]) -> None:
        self._registered += 1
        if self._rank not in ranks:
            return
        self._keys[ps_id] = f"{self._prefix}/{self.name.lower()}/{self._registered}/"
        store = self._store(ps_id)
        self._groups[ps_id] = self._make_group(store, ranks.index(self._rank), len(ranks))
        log.debug("%s group for process set %d (ranks %s) ready", self.name, ps_id, ranks)

    def _store(self, ps_id: int, suffix: str = "") -> Any:
        """The store for a group of the process set ``ps_id`` (its own key prefix, plus
        ``suffix`` for more groups of the same set), held until the set is removed."""
        store = (dist.HashStore() if self._client is None
                 else StoreAdapter(self._client, self._keys[ps_id] + suffix))  # fmt: skip
        self._stores.setdefault(ps_id, []).append(store)
        return store

    def _make_group(self, store: Any, rank: int, size: int) -> Any:
        before = set(_thread_names())  # the device starts the loop thread, the group others
        # the options torch.distributed itself builds (the only way to name the device)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        opts._timeout = self._timeout
        group = dist.ProcessGroupGloo(store, rank, size, opts)
        _lower_loop_priority(before)
        return group

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None:
        self._groups.pop(ps_id, None)  # the groups go first, then the stores they used
        self._stores.pop(ps_id, None)

    def close(self) -> None:
        self._groups.clear()
        self._stores.clear()

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int) -> None:
        if dtype not in _GLOO_REDUCES:  # int16, uint16
            registry.allreduce(comm, buf, dtype, op)
            return
        if buf.size == 0:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = (_BOOL_OPS if dtype == "bool" else _OPS)[op]
        t = self._tensor(buf, dtype)
        self._group(comm).allreduce([t], opts).wait()
        self._done(t, buf)

    def reducescatterv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                       counts: list[int], dtype: str, op: int) -> None:  # fmt: skip
        if dtype not in _GLOO_REDUCES:
            registry.reducescatterv_ring(comm, send, recv, counts, dtype, op)
            return
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = (_BOOL_OPS if dtype == "bool" else _OPS)[op]
        src = self._tensor(send, dtype)
        pieces = split(src, counts)
        out = self._tensor(recv, dtype)
        self._group(comm).reduce_scatter([out], [pieces], opts).wait()
        self._done(out, recv)

    def allgatherv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                   counts: list[int]) -> None:  # fmt: skip
        width = max(counts)
        if width == 0:
            return
        if all(c == width for c in counts):
            out = self._bytes(recv)
            self._group(comm)._allgather_base(out, self._bytes(send)).wait()
            self._done(out, recv)
            return
        padded = np.zeros(width, dtype=send.dtype)
        padded[: send.size] = send
        every = np.empty(width * len(counts), dtype=send.dtype)
        out = self._bytes(every)
        self._group(comm)._allgather_base(out, self._bytes(padded)).wait()
        self._done(out, every)
        off = 0
        for r, c in enumerate(counts):
            recv[off : off + c] = every[r * width : r * width + c]
            off += c

    def broadcast(self, comm: SetComm, buf: np.ndarray, root: int) -> None:
        if buf.size == 0:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        t = self._bytes(buf)
        self._group(comm).broadcast([t], opts).wait()
        self._done(t, buf)

    def alltoallv(self, comm: SetComm, send: np.ndarray, send_counts: list[int],
                  recv: np.ndarray, recv_counts: list[int]) -> None:  # fmt: skip
        k = send.itemsize
        out = self._bytes(recv)
        self._group(comm).alltoall_base(
            out, self._bytes(send), [c * k for c in recv_counts], [c * k for c in send_counts],
            dist.AllToAllOptions(),
        ).wait()  # fmt: skip
        self._done(out, recv)

    def adasum(self, comm: SetComm, buf: np.ndarray, dtype: str,
               segments: list[tuple[int, int]]) -> None:  # fmt: skip
        registry.adasum(comm, buf, dtype, segments)  # hora's algorithm over hora's transport

    def barrier(self, comm: SetComm) -> None:
        self._group(comm).barrier().wait()

    # -- buffers: shared with torch here; the NCCL backend copies them to its GPU -----------
    def _group(self, comm: SetComm) -> Any:
        return self._groups[comm.process_set_id]

    def _tensor(self, buf: np.ndarray, dtype: str) -> torch.Tensor:
        """``buf`` as a tensor of ``dtype``'s torch type, sharing its memory."""
        arr = buf if buf.flags.writeable else buf.copy()  # torch wants writable memory
        if dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr.view(np.uint8) if dtype == "bool" else arr)

    def _bytes(self, buf: np.ndarray) -> torch.Tensor:
        arr = buf if buf.flags.writeable else buf.copy()
        return torch.from_numpy(arr.view(np.uint8))

    def _done(self, t: torch.Tensor, buf: np.ndarray) -> None:
        """The collective wrote ``t``; make ``buf`` hold the result (shared: nothing to do)."""


def split(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``t`` cut into consecutive pieces of ``counts`` elements (views, no copies)."""
    pieces, off = [], 0
    for c in counts:
        pieces.append(t[off : off + c])
        off += c
    return pieces
