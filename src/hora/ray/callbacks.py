"""The driver's side of ``callbacks`` (:mod:`hora.ray.ray_logger` is the workers' side).

A :class:`CallbackRelay` makes the Ray queue the workers log into (a zero-CPU actor) and a
thread in this process that calls every callback with each value, in the order logged. The
values logged before the workers returned are all delivered before :meth:`CallbackRelay.close`
returns (a worker's ``put`` waits for the queue). A callback that raises stops the deliveries;
``close`` raises its exception once the job is over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ray.util.queue import Empty, Queue

log = logging.getLogger("hora.ray")

_WAIT = 0.1  # seconds the thread waits on the queue before it looks whether to stop


class CallbackRelay:
    """Calls ``callbacks`` on this process with what the workers log; ``queue`` goes to them."""

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]]) -> None:
        for c in callbacks:
            if not callable(c):
                raise TypeError(f"callbacks: {c!r} is not callable")
        self._callbacks = list(callbacks)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="hora-ray-callbacks", daemon=True)
        self._thread.start()

    def _deliver(self, value: Any) -> None:
        if self._error is not None:
            return
        try:
            for c in self._callbacks:
                c(value)
        except BaseException as e:  # raised by close(), after the job
            log.error("hora.ray: a callback raised %r; no more values are delivered", e)
            self._error = e

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.queue.get(timeout=_WAIT)
            except Empty:
                continue
            except Exception as e:  # the queue's actor is gone
                log.debug("hora.ray: the callbacks' queue: %s", e)
                return
            self._deliver(value)

    def close(self, raise_error: bool = True) -> None:
        """Deliver what is left, stop the thread and the queue; then raise a callback's error
        (with ``raise_error``)."""
        self._stop.set()
        self._thread.join(timeout=30.0)
        try:
            while not self.queue.empty():
                self._deliver(self.queue.get_nowait())
        except Exception as e:  # the queue's actor is gone: nothing more to deliver
            log.debug("hora.ray: draining the callbacks' queue: %s", e)
        finally:
            self.queue.shutdown(force=True)
        if raise_error and self._error is not None:
            raise self._error


def relay(callbacks: Sequence[Callable[[Any], Any]] | None) -> CallbackRelay | None:
    """A relay for ``callbacks``, or None when there are none."""
    return CallbackRelay(callbacks) if callbacks else None
