"""Handles: what every ``*_async`` call returns, a small future the engine thread completes.

A :class:`Handle` acts as Horovod's integer handle too (``int(h)``, ``poll(h)``,
``synchronize(h)`` with the int), through :class:`HandleTable`. :data:`in_flight` holds the
names of the ops submitted and not yet done, so that a second op of the same name raises at
once. Thread-safe: the user thread waits, the engine thread completes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hora.errors import DUPLICATE_NAME_MESSAGE, ShutDownError

_counter = itertools.count()


class Handle:
    __slots__ = (
        "_id",
        "_done",
        "_gate",
        "_result",
        "_error",
        "_finalize",
        "_callbacks",
        "__weakref__",
    )

    def __init__(self, finalize: Callable[[Any], Any] | None = None) -> None:
        self._id = next(_counter)
        # A bare lock, held from creation until completion (lighter than a threading.Event):
        # a waiter acquires it and passes it on at once, so any number of threads can wait.
        self._done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finalize = finalize
        self._callbacks: list[Callable[[Handle], None]] = []

    # -- engine side ----------------------------------------------------------------------
    def set_result(self, raw: Any) -> None:
        if self._done:
            return
        try:
            self._result = self._finalize(raw) if self._finalize is not None else raw
        except BaseException as e:  # a finalizer's failure belongs to the caller
            self._error = e
        self._complete()

    def set_error(self, error: BaseException) -> None:
        if self._done:
            return
        self._error = error
        self._complete()

    def _complete(self) -> None:
        self._done = True
        self._gate.release()
        for cb in self._callbacks:
            cb(self)

    # -- user side --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def _wait(self, timeout: float | None) -> bool:
        if self._done:
            return True
        if timeout is None:
            got = self._gate.acquire()
        elif timeout > 0:
            got = self._gate.acquire(timeout=timeout)
        else:
            got = self._gate.acquire(blocking=False)
        if got:
            self._gate.release()
        return got

    def wait(self, timeout: float | None = None) -> Any:
        if not self._wait(timeout):
            raise TimeoutError(f"handle {self._id} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    result = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Run ``fn(handle)`` when done (in the engine thread, or now if already done)."""
        self._callbacks.append(fn)
        if self._done and fn in self._callbacks:
            self._callbacks.remove(fn)
            fn(self)

    def __int__(self) -> int:
        return self._id

    __index__ = __int__

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Handle):
            return other._id == self._id
        return isinstance(other, int) and other == self._id

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<hora.Handle {self._id} {state}>"


class HandleTable:
    """Int -> Handle for Horovod-style ``poll(int)`` / ``synchronize(int)``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, Handle] = {}

    def add(self, h: Handle) -> Handle:
        with self._lock:
            self._handles[int(h)] = h
        return h

    def resolve(self, handle: Handle | int) -> Handle | None:
        if isinstance(handle, Handle):
            return handle
        with self._lock:
            return self._handles.get(int(handle))

    def release(self, handle: Handle | int) -> None:
        with self._lock:
            self._handles.pop(int(handle), None)


Key = tuple[int, str]  # (process set id, op name without its op prefix)


class NamesInFlight:
    """The names of every op submitted and not yet done. Thread-safe without a lock: user
    threads claim, the engine thread releases, each name by one dictionary call, which is
    atomic (a blocking loop's call claims and releases its name every time)."""

    def __init__(self) -> None:
        self._names: dict[Key, object] = {}  # each name's claim: an object made for it

    def claim(self, keys: list[Key], ops: Sequence[Any]) -> None:
        """Take all of ``keys`` (``ops``: each one's op, an ``OpType`` or its lower-case name,
        for the error), or none of them: ValueError when one is still in flight."""
        names, mine = self._names, object()
        for i, (key, op) in enumerate(zip(keys, ops)):
            if names.setdefault(key, mine) is not mine:
                for taken in keys[:i]:  # none but this claim releases them: not submitted yet
                    names.pop(taken, None)
                _duplicate(key, op)

    def claim_one(self, key: Key, op: Any) -> None:
        """:meth:`claim` of one name, ``key`` (``op``, its op)."""
        mine = object()
        if self._names.setdefault(key, mine) is not mine:
            _duplicate(key, op)

    def release(self, *keys: Key) -> None:
        """Free the names of an op that is done."""
        names = self._names
        for key in keys:
            names.pop(key, None)


def _duplicate(key: Key, op: Any) -> None:
    """The error for ``key``, claimed while still in flight (``op``: its op)."""
    op = op if isinstance(op, str) else op.name.lower()
    raise ValueError(DUPLICATE_NAME_MESSAGE.format(op=op, name=key[1]))


in_flight = NamesInFlight()


def shut_down_error(cause: str = "", during: str = "") -> ShutDownError:
    """Horovod's shutdown message (scripts match it), then the first cause and the op the
    caller was in, each on a line of its own when known."""
    from hora.errors import SHUT_DOWN_MESSAGE

    text = SHUT_DOWN_MESSAGE + (f"\nCause: {cause}" if cause else "")
    return ShutDownError(text + (f"\nThe caller was in: {during}" if during else ""))
