"""TcpPair: one authenticated TCP connection to one peer on one channel (see transport/base.py).

Blocking ``send``/``recv_into``/``send_msg``/``recv_msg`` run on the calling (engine) thread and
move the caller's buffer straight to or from the socket. ``isend`` sends at once whatever the
socket accepts without blocking; the rest of it, and every ``irecv``, is queued to two daemon
threads owned by the pair (one sender, one receiver, started on first use). A blocking call first
waits for the background operations queued before it, which keeps the order.

Thread-safety: one thread issues the operations (the engine thread); ``close`` is safe from any
thread and makes every blocked or later operation raise TransportError.
"""

from __future__ import annotations

import socket
import threading
from functools import partial

from hora.errors import TransportError
from hora.transport import tally
from hora.transport.base import CONTROL, DATA, MAX_MESSAGE, Buffer
from hora.transport.lanes import Completion, Lane
from hora.transport.tcp.liveness import unacked_silence
from hora.transport.tcp.wire import (
    DATA_FRAME,
    FRAME_NAMES,
    HEADER,
    MAGIC,
    MSG_FRAME,
    VERSION,
    hard_close,
    recv_exact,
    recv_exact_into,
    send_parts,
    send_rest,
)

_DONE = Completion(done=True)  # shared by every isend that completed at once


def byte_view(buf: Buffer, writable: bool = False) -> memoryview:
    """A flat byte view of ``buf`` without copying; TypeError if it is not contiguous."""
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise TypeError(
            f"transport buffers must be contiguous bytes-like objects, got {type(buf).__name__}: "
            f"{e}"
        ) from e
    if writable and view.readonly:
        raise TypeError(f"cannot receive into a read-only buffer ({type(buf).__name__})")
    return view


class TcpPair:
    """This rank's connection to rank ``peer`` on ``channel`` (DATA or CONTROL)."""

    def __init__(self, sock: socket.socket, peer: int, channel: int) -> None:
        self.peer = peer
        self.channel = channel
        self._sock = sock
        self._fd = sock.fileno()
        self._what = f"rank {peer} ({'control' if channel == CONTROL else 'data'} channel)"
        self._header = bytearray(HEADER.size)
        self._close_lock = threading.Lock()
        self._closed = False
        self._error: TransportError | None = None
        self._sender = Lane(f"hora-tcp-send-{peer}-{channel}", self._closed_error)
        self._receiver = Lane(f"hora-tcp-recv-{peer}-{channel}", self._closed_error)
        self._tally = tally.TCP if channel == DATA else tally.IGNORED  # data frames counted

    def __repr__(self) -> str:
        return f"TcpPair({self._what}, {'closed' if self._closed else 'open'})"

    # -- public operations (engine thread) ---------------------------------------------------

    def send(self, buf: Buffer) -> None:
        view = byte_view(buf)
        self._count(view.nbytes, tally.SENT)
        self._sender.drain()
        self._send_data(view)

    def recv_into(self, buf: memoryview | bytearray) -> None:
        view = byte_view(buf, writable=True)
        self._receiver.drain()
        self._recv_data(view)

    def isend(self, buf: Buffer) -> Completion:
        """Send what the socket takes at once; the sender thread finishes the rest."""
        view = byte_view(buf)
        self._count(view.nbytes, tally.SENT)
        if self._closed or not self._sender.idle():
            return self._sender.submit(partial(self._send_data, view))
        head = HEADER.pack(MAGIC, VERSION, DATA_FRAME, view.nbytes)
        try:
            sent = send_parts(self._sock, head, view, socket.MSG_DONTWAIT)
        except OSError as e:
            return Completion(self._fail(e))
        if sent == len(head) + view.nbytes:
            return _DONE
        return self._sender.submit(partial(self._send_rest, head, view, sent))

    def irecv(self, buf: memoryview | bytearray) -> Completion:
        view = byte_view(buf, writable=True)
        return self._receiver.submit(partial(self._recv_data, view))

    def send_msg(self, payload: bytes) -> None:
        view = byte_view(payload)
        if view.nbytes > MAX_MESSAGE:
            raise ValueError(f"message of {view.nbytes} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}")
        self._sender.drain()
        self._send_frame(MSG_FRAME, view)

    def recv_msg(self) -> bytes:
        self._receiver.drain()
        length = self._read_header(MSG_FRAME)
        try:
            return recv_exact(self._sock, length)
        except (OSError, EOFError) as e:
            raise self._fail(e) from e

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Close the connection; blocked and later operations raise TransportError. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                self._error = TransportError(f"connection to {self._what} was closed by this rank")
        self._sender.close()
        self._receiver.close()
        hard_close(self._sock)
        self._sender.join()
        self._receiver.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def unacked_silence(self) -> float | None:
        """Seconds since the peer's host last acknowledged anything, while data sent to it
        is unacknowledged; None when none is (:mod:`hora.transport.tcp.liveness`). Any
        thread."""
        return unacked_silence(self._sock)

    def abort(self, reason: str) -> None:
        """Fail the connection because of ``reason`` (words about its peer): every blocked
        and later operation raises TransportError naming the peer and the reason. Any
        thread."""
        self._fail(f"connection to {self._what} failed: {reason}")

    # -- frame I/O (engine thread or the pair's lane threads) --------------------------------

    def _closed_error(self) -> TransportError:
        return TransportError(str(self._error))

    def _fail(self, reason: str | BaseException) -> TransportError:
        """Record why the pair broke, close it, and return the error to raise."""
        with self._close_lock:
            if self._error is None and not self._closed:
                if isinstance(reason, EOFError):
                    reason = f"connection to {self._what} closed (peer exited or was killed)"
                elif isinstance(reason, TimeoutError):
                    reason = f"connection to {self._what} timed out (peer host unreachable?)"
                elif isinstance(reason, OSError):
                    reason = f"connection to {self._what} failed: {reason}"
                self._error = TransportError(str(reason))
        self.close()
        return self._closed_error()

    def _send_data(self, view: memoryview) -> None:
        self._send_frame(DATA_FRAME, view)

    def _send_frame(self, kind: int, view: memoryview) -> None:
        if self._closed:
            raise self._closed_error()
        head = HEADER.pack(MAGIC, VERSION, kind, view.nbytes)
        try:
            send_rest(self._sock, head, view, send_parts(self._sock, head, view))
        except OSError as e:
            raise self._fail(e) from e

    def _send_rest(self, head: bytes, view: memoryview, sent: int) -> None:
        if self._closed:
            raise self._closed_error()
        try:
            send_rest(self._sock, head, view, sent)
        except OSError as e:
            raise self._fail(e) from e

    def _recv_data(self, view: memoryview) -> None:
        """Read one data frame into ``view``: header and payload with one system call if it can."""
        if self._closed:
            raise self._closed_error()
        try:
            got = self._sock.recvmsg_into([self._header, view])[0]
            if got < HEADER.size:
                if got == 0:
                    raise EOFError("connection closed by the peer")
                recv_exact_into(self._sock, memoryview(self._header)[got:])
                got = HEADER.size
            self._check_header(DATA_FRAME, view.nbytes)
            if got - HEADER.size < view.nbytes:
                recv_exact_into(self._sock, view[got - HEADER.size :])
        except (OSError, EOFError) as e:
            raise self._fail(e) from e
        self._count(view.nbytes, tally.RECEIVED)

    def _count(self, nbytes: int, way: int) -> None:
        """Count a data frame (:mod:`hora.transport.tally`): the kernel copies it once on
        each side."""
        counts = tally.counts
        counts[self._tally + way] += nbytes
        counts[self._tally + tally.COPIED] += nbytes

    def _read_header(self, kind: int) -> int:
        """Read and check the header of one message frame; return its length."""
        if self._closed:
            raise self._closed_error()
        try:
            recv_exact_into(self._sock, memoryview(self._header))
        except (OSError, EOFError) as e:
            raise self._fail(e) from e
        return self._check_header(kind, None)

    def _check_header(self, kind: int, length: int | None) -> int:
        """Check magic, version, kind and length (exact, or at most MAX_MESSAGE if None)."""
        magic, version, got_kind, got_length = HEADER.unpack(self._header)
        length_ok = got_length == length or (length is None and got_length <= MAX_MESSAGE)
        if magic == MAGIC and version == VERSION and got_kind == kind and length_ok:
            return int(got_length)
        if magic != MAGIC or version != VERSION:
            problem = f"bad magic/version {magic:#x}/{version}"
        elif got_kind != kind:
            problem = f"expected a {FRAME_NAMES[kind]}, got {FRAME_NAMES.get(got_kind, got_kind)}"
        elif length is not None:
            problem = f"expected {length} bytes, the peer sent {got_length}"
        else:
            problem = f"message of {got_length} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}"
        raise self._fail(f"malformed frame from {self._what}: {problem}")
