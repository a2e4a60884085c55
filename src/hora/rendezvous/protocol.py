"""Wire format of the rendezvous store (shared by client and server; no pickle).

Each message is a frame: a 4-byte length, then the body. A request body is ``op`` (u8),
``timeout`` (f64 seconds, negative = none), ``number`` (i64), the key count (u16), each key as
u16 length + UTF-8, and the rest of the body is the value. A reply body is ``status`` (u8),
``number`` (i64) and the rest is the value (an error message when status is ERROR).

Connections first run the HMAC handshake of :mod:`hora.transport.tcp.auth` with context
:data:`STORE_CONTEXT`. Pure functions; thread-safe.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

from hora.transport.tcp.wire import recv_exact

SET, GET, ADD, CHECK, DELETE, WAIT = 1, 2, 3, 4, 5, 6
OP_NAMES = {SET: "set", GET: "get", ADD: "add", CHECK: "check", DELETE: "delete", WAIT: "wait"}
OK, TIMEOUT, ERROR = 0, 1, 2

STORE_CONTEXT = b"hora-store/1"
MAX_FRAME = 64 << 20
_LENGTH = struct.Struct("!I")
_REQUEST = struct.Struct("!BdqH")
_KEY = struct.Struct("!H")
_REPLY = struct.Struct("!Bq")


@dataclass
class Request:
    op: int
    keys: list[str] = field(default_factory=list)
    value: bytes = b""
    number: int = 0
    timeout: float = -1.0


def encode_request(req: Request) -> bytes:
    parts = [_REQUEST.pack(req.op, req.timeout, req.number, len(req.keys))]
    for key in req.keys:
        raw = key.encode()
        if len(raw) > 0xFFFF:
            raise ValueError(f"store key of {len(raw)} bytes is too long (65535 at most)")
        parts += [_KEY.pack(len(raw)), raw]
    parts.append(req.value)
    return b"".join(parts)


def decode_request(body: bytes) -> Request:
    """Parse a request body; ValueError (never anything else) if it is malformed."""
    try:
        op, timeout, number, count = _REQUEST.unpack_from(body)
        at = _REQUEST.size
        keys = []
        for _ in range(count):
            (n,) = _KEY.unpack_from(body, at)
            at += _KEY.size
            if at + n > len(body):
                raise ValueError("key runs past the end of the request")
            keys.append(body[at : at + n].decode())
            at += n
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed request: {e}") from e
    if op not in OP_NAMES:
        raise ValueError(f"unknown operation {op}")
    return Request(op, keys, body[at:], number, timeout)


def encode_reply(status: int, number: int = 0, value: bytes = b"") -> bytes:
    return _REPLY.pack(status, number) + value


def decode_reply(body: bytes) -> tuple[int, int, bytes]:
    try:
        status, number = _REPLY.unpack_from(body)
    except struct.error as e:
        raise ValueError(f"malformed reply: {e}") from e
    return status, number, body[_REPLY.size :]


def send_frame(sock: socket.socket, body: bytes) -> None:
    if len(body) > MAX_FRAME:
        raise ValueError(f"store message of {len(body)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> bytes:
    """One frame body; EOFError if the connection ends, ValueError if the length is absurd."""
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"store message of {length} bytes exceeds {MAX_FRAME}")
    return recv_exact(sock, length)


# How each rank of a job left, as its launcher saw it ("exited with code 0", "was killed by
# signal 9 (SIGKILL)"): the launcher sets DEPARTURES_REPORTED when the job starts, then one key
# per rank as its process ends, so a rank that finds a peer gone can say how it went.
DEPARTURES_REPORTED = "hora/left/reported"


def departure_key(rank: int) -> str:
    """The store key under which the launcher records how ``rank`` left."""
    return f"hora/left/{rank}"
