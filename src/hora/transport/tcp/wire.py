"""Byte-level helpers of the TCP transport: frame header, exact reads and writes, socket options.

A frame is a 12-byte header (magic, version, kind, payload length; network byte order) followed
by the payload. Reads never go past what they were asked for, so a socket that selects readable
holds the start of a frame and nothing is buffered in user space.

Pure functions over sockets; they run on whichever thread calls them and are thread-safe as long
as one socket is not read (or written) by two threads at once.
"""

from __future__ import annotations

import contextlib
import socket
import struct

MAGIC = 0x484F  # "HO"
VERSION = 1
DATA_FRAME = 1
MSG_FRAME = 2
FRAME_NAMES = {DATA_FRAME: "data frame", MSG_FRAME: "message frame"}
HEADER = struct.Struct("!HBBQ")  # magic, version, kind, payload length

KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
# How long sent data may stay unacknowledged, or a receiver's window stay shut, before the
# connection fails. Linux counts a zero window against it even while the peer's kernel answers
# every probe, so this is also the longest a peer may stop reading (SIGSTOP, a debugger, a swap
# storm) and still resume: a minute, past the 25-40 s pauses a job must survive. Idle
# connections to a vanished host still fail within seconds, through the keepalive probes, and
# connections with data in flight to it through hora.transport.tcp.liveness.
USER_TIMEOUT_MS = 60_000


def configure(sock: socket.socket) -> None:
    """Low latency and fast dead-peer detection: TCP_NODELAY plus short keepalive probes.

    An idle connection to a vanished host fails after about ``2 + 2 * 3`` seconds; unacknowledged
    data, or a peer that stops reading, fails after ``USER_TIMEOUT_MS`` (a minute), unless the
    transport's watch (:mod:`hora.transport.tcp.liveness`) fails it first.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (a byte view) from ``sock``; raise EOFError if the peer closes first."""
    size = view.nbytes
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError("connection closed by the peer")
        got += n


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``; raise EOFError if the peer closes first. Where the
    socket blocks, one system call reads them straight into the bytes returned (no zeroed
    buffer, no copy); a short read (a timeout set, a signal) finishes the usual way."""
    if size == 0:
        return b""
    first = sock.recv(size, socket.MSG_WAITALL)
    if len(first) == size:
        return first
    if not first:
        raise EOFError("connection closed by the peer")
    buf = bytearray(size)
    buf[: len(first)] = first
    recv_exact_into(sock, memoryview(buf)[len(first) :])
    return bytes(buf)


def send_parts(sock: socket.socket, head: bytes, body: memoryview, flags: int = 0) -> int:
    """One gathering ``sendmsg`` of ``head`` then ``body`` (no copy); return the bytes sent.

    With ``flags=socket.MSG_DONTWAIT`` it sends only what fits now (0 if nothing does).
    """
    try:
        return sock.sendmsg([head, body], (), flags)
    except BlockingIOError:
        return 0


def send_rest(sock: socket.socket, head: bytes, body: memoryview, sent: int) -> None:
    """Finish sending ``head`` + ``body`` of which the first ``sent`` bytes already went."""
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < body.nbytes:
        sock.sendall(body[sent - len(head) :])


def hard_close(sock: socket.socket) -> None:
    """Shut ``sock`` down (waking any thread blocked on it) and close it; never raises."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
