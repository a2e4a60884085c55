"""The ``torch.distributed.Work`` objects that hora's process group returns.

A :class:`HoraWork` (an asynchronous call: ``async_op=True``, DDP's buckets) wraps the hora
handles of one torch call. When the last handle completes (in hora's engine thread) it runs
the call's finishing step (copying results into torch's output tensors), then completes its
``torch.futures.Future`` with the list of output tensors, as DDP's reducer and comm hooks
expect; ``wait()`` blocks the caller until then. A failure of the engine (a peer lost, a
mismatch between ranks, a stall) reaches both as ``torch.distributed.DistBackendError`` naming
the torch call. Thread-safe: the engine thread
completes, any user thread waits.

A :class:`DoneWork` is a call that completed before it returned: a blocking call, which the
group runs in the caller's thread (its failure raised there), needs no future, lock or callback.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import hora.torch as hvd

_Error: type[Exception] = getattr(dist, "DistBackendError", RuntimeError)


def backend_error(call: str, error: BaseException) -> Exception:
    """A torch error for hora's failure ``error`` in the torch call ``call``."""
    if isinstance(error, _Error):
        return error
    text = str(error).strip() or type(error).__name__
    return _Error(f"hora backend: {call} failed: {text}")


class HoraWork(dist.Work):
    """One torch collective in flight on hora's engine."""

    def __init__(
        self,
        call: str,
        outputs: list[torch.Tensor],
        handles: Sequence[Any] = (),
        finish: Callable[[list[Any]], None] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._on_error = on_error
        self._call = call
        self._outputs = outputs
        self._finish = finish
        # torch's C++ side (DDP's reducer) sees a failure only as an error of the future it
        # holds, which a callback raising gives: ``_done`` fires ``_future``, which raises or
        # gives the outputs
        self._done: torch.futures.Future[None] = torch.futures.Future()
        self._future: torch.futures.Future[list[torch.Tensor]] = self._done.then(self._value)
        self._error: Exception | None = None
        self._handles = list(handles)
        self._settled = False
        self._settling = threading.Lock()  # held while one thread settles the work
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self.source: list[int] = []  # a receive's sender (group rank), once it is done
        if not self._handles:
            self._settle()
            return
        for i, h in enumerate(self._handles):
            h.add_done_callback(lambda h, i=i: self._one_done(i))

    def _one_done(self, i: int) -> None:
        """A handle's completion (the engine thread): the last one settles the work."""
        with self._lock:
            if i in self._seen:  # a callback may be offered twice around completion
                return
            self._seen.add(i)
            if len(self._seen) < len(self._handles):
                return
        self._settle()

    def _settle(self) -> None:
        """Once every handle is done, in whichever thread comes first (the engine's callback
        or a waiter): collect the results, run the finishing step, complete the future."""
        with self._settling:
            if self._settled:
                return
            results = []
            for h in self._handles:
                try:
                    results.append(hvd.synchronize(h))  # done: returns at once, frees the int
                except BaseException as e:  # noqa: BLE001 - every failure goes to the waiter
                    results.append(None)
                    if self._error is None:
                        self._error = backend_error(self._call, e)
            if self._error is None and self._finish is not None:
                try:
                    self._finish(results)
                except BaseException as e:  # noqa: BLE001
                    self._error = backend_error(self._call, e)
            self._handles = []
            self._settled = True
        if self._error is not None and self._on_error is not None:
            self._on_error()
        self._done.set_result(None)

    def _value(self, _: Any) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._outputs

    def _wait_handles(self) -> None:
        for h in list(self._handles):
            with contextlib.suppress(BaseException):  # _settle reports it
                h.wait()
        self._settle()

    # -- torch's side -----------------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until the collective is over; raise its failure (DistBackendError)."""
        if not self._settled:
            self._wait_handles()
        if self._error is not None:
            raise self._error
        return True

    def wait_quietly(self) -> None:
        """Block until the collective is over, whatever its outcome."""
        if not self._settled:
            self._wait_handles()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def _source_rank(self) -> int:
        """A receive's sender, its rank in the group (torch's ``recv`` without ``src`` asks);
        waits for the receive."""
        self.wait()
        if not self.source:
            raise RuntimeError(f"hora backend: {self._call} has no source rank: only a "
                               "receive has one")  # fmt: skip
        return self.source[0]

    def is_completed(self) -> bool:
        return self._settled

    def is_success(self) -> bool:
        return self._settled and self._error is None

    def exception(self) -> Exception | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def __repr__(self) -> str:
        state = "done" if self._settled else "pending"
        return f"<HoraWork {self._call} {state}>"


class DoneWork(dist.Work):
    """A collective that completed in the caller's thread before the call returned."""

    def __init__(self, call: str, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._call = call
        self._outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Exception | None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def __repr__(self) -> str:
        return f"<DoneWork {self._call}>"
