"""How a thread waits for a shared-memory frame where ranks outnumber cores.

A thread that waits for its own collective there (a caller running its round,
:mod:`hora.core.fastpath`) polls a frame's socket a while before it blocks, giving its core to
any other runnable thread between polls: a peer that needs the core gets it at once, and the
frame is read without the wake-up a blocked reader needs. :func:`yield_while_waiting` sets how
long, per thread; :class:`~hora.transport.shm.pair.ShmPair` reads it before each frame.

:func:`wait_words` is how members of a shared arena wait for one another's words
(:meth:`hora.transport.shm.arena.Arena.words`) instead of a message on every pair: polling,
yielding the core between polls, a little while, then napping between polls, and asking after
the members still awaited now and then, so that one that is gone raises rather than hangs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

_waiting = threading.local()

# wait_words polls this long, yielding the core between polls; then naps between polls (nap,
# at most _NAP_MAX seconds), and asks after the members still awaited every _CHECK_S seconds
_POLL_S = 2e-3
NAP_MIN, _NAP_MAX = 20e-6, 1e-3
_CHECK_S = 0.1


def yield_while_waiting(seconds: float) -> None:
    """How long this thread's receives on shared-memory pairs poll, yielding, before they
    block (0: they block at once, the default)."""
    _waiting.spin = seconds


def waiting_spin() -> float:
    """This thread's setting from :func:`yield_while_waiting`."""
    return float(getattr(_waiting, "spin", 0.0))


def poll_yielding(sock: socket.socket, seconds: float) -> None:
    """Wait up to ``seconds`` for ``sock`` to have data (or its end), yielding the core
    between polls."""
    deadline = time.perf_counter() + seconds
    while True:
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return  # data, or the end (the read that follows reports it)
        except BlockingIOError:
            pass
        except OSError:
            return
        if time.perf_counter() > deadline:
            return
        os.sched_yield()


def wait_words(words: Sequence[np.ndarray], index: int, at_least: int, members: Sequence[int],
               check: Callable[[int], None]) -> None:  # fmt: skip
    """Wait until word ``index`` of every member in ``members`` is at least ``at_least``
    (``words[j]``: member ``j``'s words). ``check(j)`` is called for each member still awaited
    every :data:`_CHECK_S` seconds once the polling is over; it raises if ``j`` is gone."""
    pending = [j for j in members if words[j][index] < at_least]
    if not pending:
        return
    start = time.perf_counter()
    next_check = start + _CHECK_S
    nap = 0.0
    while True:
        pending = [j for j in pending if words[j][index] < at_least]
        if not pending:
            return
        now = time.perf_counter()
        if now - start < _POLL_S:
            os.sched_yield()
            continue
        if now > next_check:
            for j in pending:
                check(j)
            next_check = now + _CHECK_S
        nap = sleep_nap(nap, _NAP_MAX)


def sleep_nap(last: float, most: float) -> float:
    """Sleep the nap after one of ``last`` seconds (0: the first) between two polls: twice as
    long, from :data:`NAP_MIN` up to ``most``; returns it."""
    nap = min(max(2 * last, NAP_MIN), most)
    time.sleep(nap)
    return nap


def peer_closed(fd: int) -> bool:
    """Whether the socket ``fd`` has reached its end (the process at the other end is gone,
    or closed it); reads nothing."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.close()
