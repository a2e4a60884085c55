"""Telling a vanished host from a slow peer on TCP, from the kernel's own books.

A connection whose far host vanishes (powered off, its link down, its namespace torn down)
with data still unacknowledged sees no error until ``TCP_USER_TIMEOUT`` (a minute,
:data:`hora.transport.tcp.wire.USER_TIMEOUT_MS`): the kernel retransmits with an exponential
backoff and keepalive probes do not run while data is in flight. That minute cannot be made
shorter for every connection, because Linux also counts a shut receive window against it, and
a peer that stops reading for half a minute (a debugger, SIGSTOP, a checkpoint written by the
same thread) must survive.

The two look different in ``TCP_INFO``. A live peer's kernel acknowledges every segment that
arrives, and answers every probe of a shut window, however long its process does not read:
nothing it was sent stays unacknowledged. A vanished host acknowledges nothing: segments stay
unacknowledged and the last acknowledgement only ages. :class:`AckWatch` looks at every open
connection of a transport once a second (:data:`CHECK_S`) and fails one that has had data
unacknowledged and no acknowledgement at all for :data:`SILENCE_S` seconds at two looks in a
row, with an error that says so; the blocked send or receive on it raises that error at once
(:meth:`hora.transport.tcp.pair.TcpPair.abort`). The job then learns of the vanished host in
11-12 seconds, about as soon as it does of an idle connection's through keepalive, instead of
a minute.

Where ``TCP_INFO`` cannot be read (not Linux) the watch does nothing and the minute holds.

Runs a daemon thread per transport, from its start to its close; thread-safe.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

# no acknowledgement for this long with data in flight: the far host is gone. A live host's
# kernel answers within a round trip; lost segments are retransmitted after 0.2, 0.6, 1.4, 3.0
# and 6.2 s, so ten seconds is five retransmissions lost in a row, and no pause of a process
# reaches it (its kernel still acknowledges)
SILENCE_S = 10.0
CHECK_S = 1.0  # seconds between two looks at the connections

# struct tcp_info (linux/tcp.h): eight one-byte fields, then 32-bit ones, of which tcpi_unacked
# is the fifth and tcpi_last_ack_recv (milliseconds) the thirteenth
_INFO = struct.Struct("8x13I")
# the layout is Linux's: elsewhere the watch does nothing
_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None


def unacked_silence(sock: socket.socket) -> float | None:
    """Seconds since ``sock``'s last acknowledgement from its peer while it has data that the
    peer has not acknowledged; None when nothing is in flight, or ``TCP_INFO`` cannot be read
    (another platform, a closed socket)."""
    if _TCP_INFO is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO.size)
    except OSError:
        return None
    if len(raw) < _INFO.size:
        return None
    fields = _INFO.unpack(raw)
    unacked, last_ack_recv_ms = fields[4], fields[12]
    return last_ack_recv_ms / 1000.0 if unacked else None


class Watched(Protocol):
    """A connection :class:`AckWatch` looks after (:class:`~hora.transport.tcp.pair.TcpPair`)."""

    @property
    def closed(self) -> bool: ...

    def unacked_silence(self) -> float | None: ...

    def abort(self, reason: str) -> None: ...


class AckWatch:
    """A daemon thread that fails the connections ``pairs()`` lists once they have had data
    unacknowledged and no acknowledgement for ``silence_s`` seconds (see the module doc),
    looking every ``check_s`` seconds until :meth:`stop`."""

    def __init__(self, pairs: Callable[[], Iterable[Watched]], name: str,
                 silence_s: float = SILENCE_S, check_s: float = CHECK_S) -> None:  # fmt: skip
        self._pairs = pairs
        self._silence_s = silence_s
        self._check_s = check_s
        self._stopped = threading.Event()
        self._suspects: set[int] = set()  # the connections silent at the last look
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the watch (idempotent); does not wait for the thread, which ends within
        ``check_s``."""
        self._stopped.set()

    def check(self) -> None:
        """One look at every connection (what the thread does every ``check_s``). A connection
        fails when it was silent that long at two looks in a row: a machine that was suspended
        (a virtual machine paused, a laptop asleep) comes back with every clock ahead and every
        acknowledgement late, and then its retransmission, sent at once, is acknowledged
        before the next look."""
        suspects = set()
        for pair in self._pairs():
            if pair.closed:
                continue
            silent = pair.unacked_silence()
            if silent is None or silent < self._silence_s:
                continue
            if id(pair) not in self._suspects:
                suspects.add(id(pair))
                continue
            pair.abort(
                f"no acknowledgement from its host for {silent:.0f} s with data in flight "
                f"(the host is down, or unreachable on the network)"
            )
        self._suspects = suspects

    def _run(self) -> None:
        while not self._stopped.wait(self._check_s):
            self.check()
