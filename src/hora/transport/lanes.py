"""Completion objects and background lanes shared by the TCP and shared-memory pairs.

:class:`Completion` is the ``Work`` of an ``isend``/``irecv`` (transport/base.py): ``wait``
returns when the operation is done and re-raises its TransportError. A :class:`Lane` runs the
operations queued on it one after the other on a daemon thread started on first use, so that
operations of one direction keep their order.

Thread-safety: ``Completion`` may be finished from any thread and waited on from another;
``Lane.submit``/``drain``/``idle`` are called by the thread that issues the pair's operations,
``close`` and ``join`` from any thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from hora.errors import TransportError

JOIN_TIMEOUT = 5.0  # seconds a closing pair waits for its lane threads to end


def join_thread(thread: threading.Thread | None, timeout: float = JOIN_TIMEOUT) -> None:
    """Wait up to ``timeout`` for a pair's ``thread`` to end (none, or the caller's own: no-op),
    so that no daemon thread of a closed pair still runs when the interpreter exits."""
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


class Completion:
    """Completion of one operation; ``wait`` re-raises the transport error."""

    __slots__ = ("_event", "_error")

    def __init__(self, error: TransportError | None = None, done: bool = False) -> None:
        self._event = threading.Event()
        self._error = error
        if error is not None or done:
            self._event.set()

    def finish(self, error: TransportError | None = None) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Return when done; TimeoutError (the pair stays open) if ``timeout`` ends first."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"transport operation not done after {timeout}s")
        if self._error is not None:
            raise TransportError(str(self._error)) from self._error


class Lane:
    """A FIFO of operations run by one lazily started daemon thread."""

    def __init__(self, name: str, closed_error: Callable[[], TransportError]) -> None:
        self._name = name
        self._closed_error = closed_error
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Completion] | None]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last: Completion | None = None

    def submit(self, op: Callable[[], object]) -> Completion:
        """Queue ``op``; its Work is done when ``op`` returns, or fails with what it raised."""
        work = Completion()
        with self._lock:
            if self._closed:
                return Completion(self._closed_error())
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._last = work
            self._queue.put((op, work))
        return work

    def idle(self) -> bool:
        last = self._last
        return last is None or last.done()

    def drain(self) -> None:
        """Wait until everything submitted so far is done (its errors surface elsewhere)."""
        last = self._last
        if last is not None:
            last._event.wait()

    def close(self) -> None:
        """Refuse new operations; the thread ends after those already queued."""
        with self._lock:
            self._closed = True
            self._queue.put(None)

    def join(self) -> None:
        """After ``close`` (and after the owner closed what the operations block on): wait for
        the thread to end (:func:`join_thread`)."""
        join_thread(self._thread)

    def _loop(self) -> None:
        while self._run(self._queue.get()):
            pass

    def _run(self, item: tuple[Callable[[], object], Completion] | None) -> bool:
        """Run one queued operation; False for the end marker. The operation and its buffers
        are let go when this returns, not kept alive by an idle thread until the next one: a
        buffer over a torch tensor freed by a daemon thread while the interpreter shuts down
        aborts the process."""
        if item is None:
            return False
        op, work = item
        try:
            op()
        except TransportError as e:
            work.finish(e)
        except Exception as e:  # a bug must fail the operation, not hang its waiter
            work.finish(TransportError(f"{self._name}: {type(e).__name__}: {e}"))
        else:
            work.finish()
        return True
