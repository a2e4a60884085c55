"""The seam between collectives and the wire: a :class:`Pair` moves bytes between two ranks.

Contract (every transport implements it; collectives rely on nothing else):

* A Pair connects this rank to one peer on one *channel*. Channel ``DATA`` carries collective
  payloads; channel ``CONTROL`` carries the engine's negotiation messages. The two never share a
  connection, so a control message can never arrive in the middle of a payload.
* Ordering: frames arrive in the order they were sent. ``send``/``isend`` on one Pair are
  serialised in call order; so are ``recv_into``/``irecv``.
* ``send(buf)`` sends ``buf`` as one data frame and returns when it is handed to the OS.
  ``recv_into(buf)`` fills ``buf`` with exactly one data frame and raises
  :class:`~hora.errors.TransportError` if that frame's length is not ``len(buf)``.
* ``isend``/``irecv`` start the same operations in the background and return a :class:`Work`
  whose ``wait()`` returns when done or raises the transport error. Buffers must stay alive and
  untouched until then.
* ``send_msg(bytes)``/``recv_msg() -> bytes`` move small control messages (at most
  ``MAX_MESSAGE`` bytes). ``fileno()`` may be watched with :mod:`selectors`: the transport keeps
  no read-ahead buffer, so readable means a frame has started to arrive.
* Any failure (peer gone, reset, timeout, malformed frame) raises TransportError naming the peer
  rank, and leaves the Pair closed.

Thread-safety: a Pair is used by the engine thread only; its background work (for ``isend`` /
``irecv``) runs on threads the transport owns.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

DATA = 0
CONTROL = 1
MAX_MESSAGE = 64 << 20

Buffer = memoryview | bytearray | bytes


@runtime_checkable
class Work(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...


@runtime_checkable
class Pair(Protocol):
    peer: int

    def send(self, buf: Buffer) -> None: ...

    def recv_into(self, buf: memoryview | bytearray) -> None: ...

    def isend(self, buf: Buffer) -> Work: ...

    def irecv(self, buf: memoryview | bytearray) -> Work: ...

    def send_msg(self, payload: bytes) -> None: ...

    def recv_msg(self) -> bytes: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """All the Pairs of one rank. ``pair(peer, channel)`` connects lazily and is idempotent."""

    rank: int
    size: int

    def pair(self, peer: int, channel: int = DATA) -> Pair: ...

    def close(self) -> None: ...
