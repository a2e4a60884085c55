"""How a thread waits for a shared-memory frame where ranks outnumber cores.

A thread that waits for its own collective there (a caller running its round,
:mod:`hora.core.fastpath`) polls a frame's socket a while before it blocks, giving its core to
any other runnable thread between polls: a peer that needs the core gets it at once, and the
frame is read without the wake-up a blocked reader needs. :func:`yield_while_waiting` sets how
long, per thread; :class:`~hora.transport.shm.pair.ShmPair` reads it before each frame.
"""

from __future__ import annotations

import os
import socket
import threading
import time

_waiting = threading.local()


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
