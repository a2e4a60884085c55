"""Streams, events and pinned host memory for device (CUDA) tensors, behind one small interface.

hora moves a CUDA tensor without stopping the device: the caller's stream records an event,
hora's own copy stream waits on it, copies asynchronously into pinned host memory and records a
"copied" event that the host waits on (that event only, never a device-wide synchronize). The
way back copies on hora's stream and makes the caller's stream wait on a "done" event.

:class:`DeviceRuntime` is what ``hora.torch.adapter`` needs for that; :class:`CudaRuntime`
implements it over ``torch.cuda``; :func:`runtime` returns it when PyTorch sees a GPU, else None.
:class:`FakeCudaRuntime` is a fake for machines without a GPU: it works on CPU tensors, defers
every operation enqueued on a fake stream until an event after it is waited for, and logs the
order of stream operations, so tests can check the ordering rules without a device.

Threads: the runtimes are stateless apart from the fake's log and the cached streams (guarded
by a lock); any thread may call them (stage in the user thread, write-back in the engine
thread). :class:`PinnedPool` is thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class DeviceRuntime(Protocol):
    """Stream, event and copy primitives for one kind of device. Streams and events are opaque."""

    def serves(self, device: torch.device) -> bool:
        """Whether ``device``'s tensors have streams here (a CPU tensor has none on CUDA)."""

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device``."""

    def copy_stream(self, device: torch.device) -> Any:
        """hora's own stream on ``device`` for copies (one per device, made on first use)."""

    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device``."""

    def record_event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now: it completes when the work before it has."""

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Work enqueued on ``stream`` from now on starts after ``event`` (the host goes on)."""

    def event_synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed."""

    def event_query(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D page-locked host tensor (a target for asynchronous copies)."""

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     stream: Any) -> torch.Tensor:  # fmt: skip
        """A new 1-D tensor on ``device`` whose memory belongs to ``stream``'s allocations."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` without waiting for it."""

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``tensor`` is in use on ``stream`` (it was made on another)."""


class CudaRuntime:
    """:class:`DeviceRuntime` over ``torch.cuda``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copy_streams: dict[torch.device, Any] = {}

    def serves(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy_stream(self, device: torch.device) -> Any:
        with self._lock:
            if device not in self._copy_streams:
                self._copy_streams[device] = torch.cuda.Stream(device=device)
            return self._copy_streams[device]

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def event_query(self, event: Any) -> bool:
        return bool(event.query())

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     stream: Any) -> torch.Tensor:  # fmt: skip
        with torch.cuda.stream(stream):
            return torch.empty(numel, dtype=dtype, device=device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


_cuda: CudaRuntime | None = None


def runtime() -> DeviceRuntime | None:
    """The CUDA runtime when PyTorch sees a GPU, else None (one instance per process)."""
    global _cuda
    if not torch.cuda.is_available():
        return None
    if _cuda is None:
        _cuda = CudaRuntime()
    return _cuda


# -- a fake for machines without a GPU ----------------------------------------------------------
@dataclass
class FakeStream:
    """A fake stream: a queue of operations that run only when an event after them is awaited."""

    name: str
    pending: list[tuple[str, Callable[[], None] | FakeEvent]] = field(default_factory=list)
    done: int = 0  # operations run so far (the queue's absolute index of pending[0])

    @property
    def enqueued(self) -> int:
        return self.done + len(self.pending)


@dataclass(eq=False)
class FakeEvent:
    """A fake event: the position in its stream's queue it completes at."""

    id: int
    stream: FakeStream
    position: int


class FakeCudaRuntime:
    """A fake :class:`DeviceRuntime` on CPU tensors, for tests on machines without a GPU.

    Every copy enqueued on a fake stream is deferred: it runs when an event recorded after it is
    synchronized, or when a stream that waits on such an event is itself drained. ``log`` lists
    what was asked, in order: ``("record", stream, event)``, ``("wait", stream, event)``,
    ``("copy", stream, label)``, ``("run", stream, label)`` when a deferred operation runs,
    ``("sync", event)`` for a host wait, ``("pinned", numel)`` for each pinned allocation.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.log: list[tuple[Any, ...]] = []
        self.streams: dict[str, FakeStream] = {}
        self._current: dict[int, FakeStream] = {}  # thread id -> its current stream
        self.pinned: list[torch.Tensor] = []

    def serves(self, device: torch.device) -> bool:
        return True  # its "device" tensors are CPU tensors

    # streams
    def stream(self, name: str) -> FakeStream:
        """The fake stream called ``name`` (made on first use)."""
        with self._lock:
            return self.streams.setdefault(name, FakeStream(name))

    def set_current(self, stream: FakeStream) -> None:
        """Make ``stream`` the calling thread's current stream (``torch.cuda.stream(s)``)."""
        self._current[threading.get_ident()] = stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self._current.get(threading.get_ident()) or self.stream("default")

    def copy_stream(self, device: torch.device) -> FakeStream:
        return self.stream("hora")

    def new_stream(self, device: torch.device) -> FakeStream:
        return self.stream(f"stream{next(self._ids)}")

    def enqueue(self, stream: FakeStream, fn: Callable[[], None], label: str) -> None:
        """Defer ``fn`` on ``stream`` (what a kernel launch is); tests use it for user work."""
        with self._lock:
            stream.pending.append((label, fn))

    # events
    def record_event(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            event = FakeEvent(next(self._ids), stream, stream.enqueued)
            self.log.append(("record", stream.name, event.id))
            return event

    def stream_wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            stream.pending.append(("wait", event))
            self.log.append(("wait", stream.name, event.id))

    def event_synchronize(self, event: FakeEvent) -> None:
        with self._lock:
            self.log.append(("sync", event.id))
            self._drain(event)

    def event_query(self, event: FakeEvent) -> bool:
        return event.stream.done >= event.position

    def _drain(self, event: FakeEvent) -> None:
        """Run ``event``'s stream up to the event, first draining what its waits wait for."""
        stream = event.stream
        while stream.done < event.position:
            label, op = stream.pending.pop(0)
            stream.done += 1
            if isinstance(op, FakeEvent):
                self._drain(op)
            else:
                op()
                self.log.append(("run", stream.name, label))

    # memory and copies
    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            self.log.append(("pinned", numel))
            buf = torch.zeros(numel, dtype=dtype)  # zeros: a copy that has not run shows
            self.pinned.append(buf)
            return buf

    def device_empty(self, numel: int, dtype: torch.dtype, device: torch.device,
                     stream: Any) -> torch.Tensor:  # fmt: skip
        return torch.empty(numel, dtype=dtype)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        label = "d2h" if self.is_pinned(dst) else "h2d" if self.is_pinned(src) else "d2d"
        with self._lock:
            self.log.append(("copy", stream.name, label))

            def run() -> None:
                dst.copy_(src)

            stream.pending.append((label, run))

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            self.log.append(("keep_alive", stream.name))

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares memory with a buffer from :meth:`pinned_empty`."""
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.pinned)


# -- a pool of pinned host buffers ----------------------------------------------------------------
class PinnedPool:
    """Pinned host buffers reused by element count and dtype.

    A buffer given back with :meth:`release` is reused only once the event it was released
    with has completed (the last copy out of it is done); at most ``keep`` idle buffers are
    kept per size. Pinned memory is costly to allocate and limited, so it is never freed early
    and never handed out twice.
    """

    def __init__(self, rt: DeviceRuntime, keep: int = 4) -> None:
        self._rt, self._keep = rt, keep
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned 1-D buffer of ``numel`` elements: an idle one whose copies are done, or new."""
        with self._lock:
            idle = self._idle.get((numel, dtype), [])
            for i, (buf, event) in enumerate(idle):
                if event is None or self._rt.event_query(event):
                    del idle[i]
                    return buf
        return self._rt.pinned_empty(numel, dtype)

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; it may be handed out again once ``event`` has completed."""
        with self._lock:
            idle = self._idle.setdefault((buf.numel(), buf.dtype), [])
            if len(idle) < self._keep:
                idle.append((buf, event))

    def idle(self) -> int:
        """How many buffers wait for reuse."""
        with self._lock:
            return sum(len(v) for v in self._idle.values())
