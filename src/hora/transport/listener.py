"""The one listener of hora: accept, admit under a deadline, hand over, close.

A :class:`Listener` owns one listening socket (the TCP and shared-memory transports of every
rank, and the rendezvous store, each have one). Its accept thread hands every connection to a
short-lived daemon thread that runs the owner's ``handshake`` (hora's mutual HMAC handshake and
whatever set-up follows it); a connection that passes is removed from the listener's care and
given to the owner's ``serve`` on that same thread.

Two limits keep a port scanner, a stuck client or a slow trickle of bytes from holding threads or
file descriptors:

* **one deadline for the whole admission** (``deadline`` seconds from accept, by default
  :data:`HANDSHAKE_DEADLINE_S`; the ``HORA_HANDSHAKE_TIMEOUT_SECONDS`` setting). A read timeout
  alone restarts with every byte; this one does not. The accept thread closes every connection
  still being admitted when its time is up, which wakes its admission thread.
* **at most ``max_pending`` admissions at once.** At the cap the listener stops accepting: new
  connections wait in the kernel's backlog (no thread, no descriptor of ours) until a slot frees,
  which the deadline bounds.

Rejections are logged through a :class:`~hora.ratelog.RateLimitedLog`: the first few in full,
then a count at most every :data:`~hora.ratelog.EVERY_S` seconds. Admissions never touch an
established connection, so training traffic is not slowed while strangers knock.

Threads: one accept thread (daemon) per listener, one daemon thread per connection in admission.
:meth:`close` is idempotent and safe from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from hora.errors import AuthenticationError
from hora.ratelog import RateLimitedLog
from hora.transport.tcp.wire import hard_close

HANDSHAKE_DEADLINE_S = 5.0
MAX_PENDING = 64

REJECTED = (AuthenticationError, OSError, EOFError, ValueError)


def peer_name(addr: Any) -> str:
    """``host:port`` of a TCP peer; "this host" for a Unix-socket peer."""
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "this host"


class Listener:
    """Accepts on ``sock`` and admits each connection with ``handshake(conn, addr) -> result``
    (raising one of :data:`REJECTED` to refuse it), then calls ``serve(conn, addr, result)``,
    which owns the connection from then on. ``what`` names the listener in log lines;
    ``rejection`` is the warning for a refused connection, with ``%s`` for the peer and the
    reason."""

    def __init__(
        self,
        sock: socket.socket,
        handshake: Callable[[socket.socket, Any], Any],
        serve: Callable[[socket.socket, Any, Any], None],
        what: str,
        logger: logging.Logger,
        deadline: float = HANDSHAKE_DEADLINE_S,
        max_pending: int = MAX_PENDING,
        rejection: str = "",
    ) -> None:
        if not deadline > 0:
            raise ValueError(f"the handshake deadline must be positive, got {deadline}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.sock = sock
        self._handshake = handshake
        self._serve = serve
        self.what = what
        self._rejection = rejection or f"{what}: dropped a connection from %s: %s"
        self.deadline = deadline
        self.max_pending = max_pending
        self._log = logger
        self.rejections = RateLimitedLog(logger, "rejected connections")
        self._full = RateLimitedLog(logger, "waits at the pending-handshake cap", first=1)
        self._cond = threading.Condition()
        self._pending: dict[socket.socket, float] = {}  # connection -> its deadline
        self._expired: set[socket.socket] = set()
        self._closed = False
        self.counts = {"accepted": 0, "admitted": 0, "rejected": 0, "expired": 0}

    def start(self, thread_name: str) -> None:
        threading.Thread(target=self._accept_loop, name=thread_name, daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Connections being admitted now."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Stop accepting and close every connection still being admitted. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            socks = [self.sock, *self._pending]
            self._cond.notify_all()
        for sock in socks:
            hard_close(sock)
        self.rejections.flush(final=True)

    # -- the accept thread ------------------------------------------------------------------
    def _next_wake(self, now: float) -> float | None:
        """Seconds until the next deadline or log summary falls due; None: nothing is due."""
        due = [d for d in (min(self._pending.values(), default=None), self.rejections.next_due(),
                           self._full.next_due()) if d is not None]
        return max(min(due) - now, 0.0) + 0.01 if due else None

    def _reap(self, now: float) -> None:
        """Shut down the connections whose admission ran out of time (lock held): that wakes
        their admission threads, which report and close them."""
        for conn, deadline in list(self._pending.items()):
            if deadline <= now and conn not in self._expired:
                self._expired.add(conn)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    self._reap(now)
                    if len(self._pending) < self.max_pending:
                        break
                    self._full.warning(
                        "%s: %d handshakes in progress, the most allowed; new connections wait "
                        "in the backlog until one finishes or its %g s deadline passes",
                        self.what, len(self._pending), self.deadline,
                    )
                    self._cond.wait(self._next_wake(now))
                wait = self._next_wake(time.monotonic())
            self.rejections.flush()
            self._full.flush()
            try:
                self.sock.settimeout(wait)
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    return
                self._log.warning("%s: accept failed: %s", self.what, e)
                time.sleep(0.1)
                continue
            conn.setblocking(True)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._pending[conn] = time.monotonic() + self.deadline
                self.counts["accepted"] += 1
            threading.Thread(
                target=self._admit, args=(conn, addr), name="hora-admit", daemon=True
            ).start()

    # -- one admission thread per connection ----------------------------------------------
    def _admit(self, conn: socket.socket, addr: Any) -> None:
        try:
            result = self._handshake(conn, addr)
            error: BaseException | None = None
        except REJECTED as e:
            result, error = None, e
        except Exception as e:  # a bug in the set-up must not leak the admission slot
            self._log.exception("%s: admitting a connection failed", self.what)
            result, error = None, e
        with self._cond:
            expired = conn in self._expired
            self._expired.discard(conn)
            known = self._pending.pop(conn, None) is not None
            closed = self._closed
            self._cond.notify_all()
            if not closed:
                outcome = "expired" if expired else "admitted" if error is None else "rejected"
                self.counts[outcome] += 1
        if error is None and known and not expired and not closed:
            self._serve(conn, addr, result)
            return
        if not closed:  # logged before the close, so the peer sees the close after the log
            if expired:
                reason = f"no complete handshake within {self.deadline:g} s"
            else:
                reason = str(error) or type(error).__name__
            self.rejections.warning(self._rejection, peer_name(addr), reason)
        hard_close(conn)
