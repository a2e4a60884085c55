"""The timeline: a chrome://tracing / Perfetto JSON trace of every tensor's way through the engine.

Format (a JSON array, Horovod's layout). The file opens with ``[`` and two metadata records on
pid 0 (``process_name`` with ``start_time_since_epoch_in_micros``, and ``process_sort_index``).
Each tensor name gets its own pseudo-pid, announced by ``process_name`` and
``process_sort_index`` metadata the first time the name is seen. Events are
``{"ph", "name", "ts", "pid"}`` with ``ts`` in microseconds since the timeline started:

* ``B NEGOTIATE_<OP>``, one ``X`` event (``dur`` 0) per rank named by its rank number as that rank
  reports the tensor ready, then ``E``;
* ``B <OP>`` (ALLREDUCE, ALLGATHER, ...), nested ``B``/``E`` activities (QUEUE,
  MEMCPY_IN_FUSION_BUFFER, TCP_ALLREDUCE, ...), then ``E`` carrying ``args`` dtype and shape;
* with ``mark_cycles``, a global instant ``{"ph": "i", "name": "CYCLE_START", "s": "g"}`` per
  engine cycle.

Threads. The recording methods are called by the engine thread and cost about a microsecond: they
take a timestamp and put a tuple on a ``queue.SimpleQueue``. A writer thread owned by the
``Timeline`` drains the queue, assigns pseudo-pids, formats the records and writes them. ``close``
and ``flush`` may be called from any thread; calls made after ``close`` are ignored, so an engine
that still holds a closed timeline for the rest of a cycle does no harm.

Valid JSON at every moment. The header is written under a temporary name and renamed over the path,
so the file never exists without it. From then on the file always ends with ``]``. Records are
written with ``os.pwrite`` at the offset of that ``]``, as ``,\\n<records>\\n]``: each write
replaces the old closing bracket and brings its own, so the file is a complete JSON array before
and after every write, and a process killed between two writes (SIGKILL included) leaves the last
complete array. The data goes straight to the kernel (no user-space buffer), so it survives the
death of the process; it is not fsynced, so a crash of the whole machine may lose recent records.
Within one write, Linux checks for a fatal signal only before each page it copies: a write that
ends in the page where it starts is done completely or not at all. The writer therefore cuts each
batch into writes that stay inside one 4 KiB page; only when the next record does not fit in what
is left of the page does one write (that record and the bracket, about 100-200 bytes) straddle the
boundary. A SIGKILL arriving while the kernel copies the first part of such a write (well under a
microsecond, once per 4 KiB of trace) is the one moment that could leave a cut record; nothing
short of rewriting the whole file and renaming it over the old one closes that window, and the cost
would grow with the file.

Using it for ``start_timeline`` / ``stop_timeline`` (rank 0 only writes a timeline).
``HOROVOD_TIMELINE=<path>`` at ``init()``: the engine builds ``Timeline(path, mark_cycles)``
before its thread starts. ``start_timeline(path, mark_cycles)`` (only when
``HOROVOD_TIMELINE=DYNAMIC``): build the new ``Timeline`` in the user thread (an unwritable path
raises ``OSError`` there), then publish it with one attribute assignment that the engine thread
reads once per cycle. ``stop_timeline()``: swap the attribute to ``None``, then call ``close()``
on the old object; an event the engine records on it meanwhile is dropped. ``shutdown()`` closes
the current timeline after the engine thread has stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from typing import Any

__all__ = ["Timeline"]

log = logging.getLogger(__name__)

# Event kinds on the queue: (kind, tensor name, perf_counter_ns, detail, extra).
_NEG_START, _RANK_READY, _NEG_END, _START, _ACT_START, _ACT_END, _END, _CYCLE = range(8)
_MARK, _END_FUSED = 8, 9
_PAGE = 4096  # the kernel checks for a fatal signal only between the pages of one write
_MAX_BATCH = 4096  # queue items per write: a busy engine still sees its events land regularly


def _create(path: str, head: bytes) -> int:
    """Open a write descriptor on a new file at ``path`` that already holds ``head``.

    The file is written under a temporary name and renamed over ``path``, so ``path`` never
    shows an empty or half-written header (an older file there is replaced in one step).
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.replace(tmp, path)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


class Timeline:
    """Records engine events for rank 0's trace file; see the module docstring for the format.

    ``flush_interval`` is how long (seconds) the writer lets events gather before writing a batch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        mark_cycles: bool = False,
        flush_interval: float = 0.02,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise ValueError(f"timeline path must be a non-empty file path, got {path!r}")
        if flush_interval < 0:
            raise ValueError(f"flush_interval must be >= 0 seconds, got {flush_interval}")
        self.path = str(path)
        self.mark_cycles = bool(mark_cycles)
        self._flush_interval = flush_interval
        self._t0 = time.perf_counter_ns()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._wake = threading.Event()
        self._pids: dict[str, int] = {}
        self._open_activity: set[int] = set()
        self._failed = False
        epoch_us = time.time_ns() // 1000
        extra = "".join(f",{json.dumps(str(k))}:{json.dumps(v)}" for k, v in (meta or {}).items())
        head = (
            '[\n{"name":"process_name","ph":"M","pid":0,"args":{"name":"hora",'
            f'"start_time_since_epoch_in_micros":{epoch_us}{extra}}}}},\n'
            '{"name":"process_sort_index","ph":"M","pid":0,"args":{"sort_index":0}}\n]'
        ).encode()
        self._fd = _create(self.path, head)
        self._end = len(head) - 1  # offset of the closing bracket
        self._writer = threading.Thread(target=self._run, name="hora-timeline", daemon=True)
        self._writer.start()

    # ---- engine thread: enqueue only -----------------------------------------------------------

    def negotiate_start(self, name: str, op: str) -> None:
        """``B NEGOTIATE_<OP>`` on the tensor's row: negotiation of ``name`` began."""
        if not self._closed:
            self._queue.put((_NEG_START, name, time.perf_counter_ns(), op, None))

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        """An instant (``X``, ``dur`` 0) named ``str(rank)``: that rank reported ``name`` ready."""
        if not self._closed:
            self._queue.put((_RANK_READY, name, time.perf_counter_ns(), rank, None))

    def negotiate_end(self, name: str) -> None:
        """``E`` closing the negotiation of ``name``."""
        if not self._closed:
            self._queue.put((_NEG_END, name, time.perf_counter_ns(), None, None))

    def start(self, name: str, op: str) -> None:
        """``B <OP>``: the collective on ``name`` began (ALLREDUCE, ALLGATHER, ...)."""
        if not self._closed:
            self._queue.put((_START, name, time.perf_counter_ns(), op, None))

    def activity_start(self, name: str, activity: str) -> None:
        """``B <activity>`` inside the op (QUEUE, MEMCPY_IN_FUSION_BUFFER, TCP_ALLREDUCE, ...)."""
        if not self._closed:
            self._queue.put((_ACT_START, name, time.perf_counter_ns(), activity, None))

    def activity_end(self, name: str) -> None:
        """``E`` closing the current activity of ``name``."""
        if not self._closed:
            self._queue.put((_ACT_END, name, time.perf_counter_ns(), None, None))

    def end(
        self,
        name: str,
        dtype: str | None = None,
        shape: tuple[int, ...] | None = None,
        fused_bytes: int = 0,
    ) -> None:
        """``E`` of the op with ``args`` dtype and shape (and ``fused_bytes``, the size of the
        fusion buffer it travelled in, when it was fused); closes an activity left open first."""
        if not self._closed:
            item: tuple[int, str, int, Any, Any]
            if fused_bytes:
                item = (_END_FUSED, name, time.perf_counter_ns(), dtype, (shape, fused_bytes))
            else:
                item = (_END, name, time.perf_counter_ns(), dtype, shape)
            self._queue.put(item)

    def mark(self, name: str, args: dict[str, Any]) -> None:
        """A global instant ``name`` on pid 0 with ``args`` (autotune's trials, for one)."""
        if not self._closed:
            self._queue.put((_MARK, name, time.perf_counter_ns(), dict(args), None))

    def mark_cycle(self) -> None:
        """A global ``CYCLE_START`` instant, when the timeline was made with ``mark_cycles``."""
        if self.mark_cycles and not self._closed:
            self._queue.put((_CYCLE, "", time.perf_counter_ns(), None, None))

    # ---- any thread ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until every event recorded before this call is in the file.

        Returns False if that did not happen within ``timeout`` seconds or the timeline is closed.
        """
        if self._closed:
            return False
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, stop the writer thread and close the file. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            self._wake.set()
        self._writer.join(timeout=30.0)
        if self._writer.is_alive():
            log.error("timeline writer for %s did not finish in 30 s", self.path)
            return
        os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if self._flush_interval and isinstance(item, tuple) and not self._closed:
                self._wake.wait(self._flush_interval)
            self._wake.clear()
            batch = [item]
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            records: list[str] = []
            flushed: list[threading.Event] = []
            for item in batch:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    flushed.append(item)
                elif not stop:
                    self._format(item, records)
            if records:
                self._write(records)
            for event in flushed:
                event.set()

    def _write(self, records: list[str]) -> None:
        """Write ``records`` in writes that each end inside the page where they start."""
        chunk: list[bytes] = []
        size = 0
        room = _PAGE - self._end % _PAGE  # bytes from the closing bracket to the end of its page
        for record in records:
            piece = b",\n" + record.encode()
            if chunk and size + len(piece) + 2 > room:
                self._emit(chunk)
                chunk, size = [], 0
                room = _PAGE - self._end % _PAGE
            chunk.append(piece)
            size += len(piece)
        if chunk:
            self._emit(chunk)

    def _emit(self, pieces: list[bytes]) -> None:
        if self._failed:
            return
        data = b"".join(pieces) + b"\n]"
        try:
            os.pwrite(self._fd, data, self._end)
        except OSError as e:
            self._failed = True
            log.error("timeline %s: write failed, no more events are recorded: %s", self.path, e)
            return
        self._end += len(data) - 1

    def _pid(self, name: str, records: list[str]) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            label = json.dumps(name)
            records.append(
                f'{{"name":"process_name","ph":"M","pid":{pid},"args":{{"name":{label}}}}}'
            )
            records.append(
                f'{{"name":"process_sort_index","ph":"M","pid":{pid},"args":{{"sort_index":{pid}}}}}'
            )
        return pid

    def _format(self, item: tuple[int, str, int, Any, Any], records: list[str]) -> None:
        kind, name, t_ns, detail, extra = item
        ts = (t_ns - self._t0) // 1000
        if kind == _CYCLE:
            records.append(f'{{"ph":"i","name":"CYCLE_START","ts":{ts},"pid":0,"s":"g"}}')
            return
        if kind == _MARK:
            margs = json.dumps(detail, separators=(",", ":"))
            label = json.dumps(name)
            records.append(f'{{"ph":"i","name":{label},"ts":{ts},"pid":0,"s":"g","args":{margs}}}')
            return
        pid = self._pid(name, records)
        if kind == _NEG_START:
            label = json.dumps("NEGOTIATE_" + str(detail).upper())
            records.append(f'{{"ph":"B","name":{label},"ts":{ts},"pid":{pid}}}')
        elif kind == _RANK_READY:
            records.append(f'{{"ph":"X","name":"{int(detail)}","ts":{ts},"pid":{pid},"dur":0}}')
        elif kind in (_NEG_END, _ACT_END):
            if kind == _ACT_END:
                self._open_activity.discard(pid)
            records.append(f'{{"ph":"E","ts":{ts},"pid":{pid}}}')
        elif kind in (_START, _ACT_START):
            if kind == _ACT_START:
                if pid in self._open_activity:
                    records.append(f'{{"ph":"E","ts":{ts},"pid":{pid}}}')
                self._open_activity.add(pid)
            label = json.dumps(str(detail).upper() if kind == _START else str(detail))
            records.append(f'{{"ph":"B","name":{label},"ts":{ts},"pid":{pid}}}')
        elif kind in (_END, _END_FUSED):
            if pid in self._open_activity:
                self._open_activity.discard(pid)
                records.append(f'{{"ph":"E","ts":{ts},"pid":{pid}}}')
            args: dict[str, Any] = {}
            if detail is not None:
                args["dtype"] = str(detail)
            fused = 0
            if kind == _END_FUSED:
                extra, fused = extra
            if extra is not None:
                args["shape"] = "[" + ", ".join(str(int(d)) for d in extra) + "]"
            if fused:
                args["fused_bytes"] = fused
            tail = f',"args":{json.dumps(args, separators=(",", ":"))}' if args else ""
            records.append(f'{{"ph":"E","ts":{ts},"pid":{pid}{tail}}}')
