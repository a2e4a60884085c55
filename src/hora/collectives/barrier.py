"""Dissemination barrier: ``ceil(log2 size)`` rounds of one-byte messages.

In round ``k`` each rank sends a byte to ``rank + 2^k`` and waits for one from ``rank - 2^k``;
after the last round every rank has (transitively) heard from every other, so none leaves
before all have arrived. ``ceil(log2 size)`` latencies, 1 byte per message.

Runs on the calling (engine) thread; thread-safe for distinct Comms.
"""

from __future__ import annotations

from hora.collectives.base import Comm

_TOKEN = b"\x01"


def barrier(comm: Comm) -> None:
    """Return once every rank of the group has called ``barrier``."""
    n, rank = comm.size, comm.rank
    into = bytearray(1)
    dist = 1
    while dist < n:
        comm.pair((rank + dist) % n).send(_TOKEN)
        comm.pair((rank - dist) % n).recv_into(into)
        dist <<= 1
