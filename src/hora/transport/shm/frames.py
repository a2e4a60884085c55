"""The frames of an shm pair (:mod:`hora.transport.shm.pair`): their header, their kinds and the
limits that choose between them.

On the socket of one direction the sender writes frames, each a 24-byte header (:data:`HEADER`:
kind, slot, chunk bytes, total bytes, address), followed for an inline (``EAGER``) frame by its
payload; the receiver answers every bulk frame with one acknowledgement byte (:data:`ACK`). A
single-copy frame (``PULL``, or ``PULLV`` with a list of :data:`SPAN` after the header) carries
the address the receiver reads from; a ``STAGED`` frame names the staging slot its chunk is in.
"""

from __future__ import annotations

import struct

import numpy as np

from hora.transport import tally

HEADER = struct.Struct("=BBxxIQQ")  # kind, slot, chunk bytes, total bytes, address
SPAN = struct.Struct("=QQ")  # a gathered single-copy frame: (address, bytes) per part
EAGER, PULL, STAGED, MSG, PULLV = 1, 2, 3, 4, 5
KIND_NAMES = {
    EAGER: "inline data",
    PULL: "single-copy data",
    STAGED: "staged data",
    MSG: "message",
    PULLV: "gathered single-copy data",
}
EAGER_LIMIT = 512 << 10  # inline below: cheaper than a pull and its acknowledgement
# bytes pulled per step of a reducing receive (one system call, then reduced while it is in
# the caches): at np=2 against 256 KiB steps, a 16 MiB allreduce took 2.4-3.1 against 2.8-3.8
# ms, 64 MiB 7.3-8.8 against 9.1-12.5 ms, ResNet-50's 161 gradients fused 26.5-27.0 against
# 29.7-29.9 ms (the two alternating in one process; 2 MiB steps were no better)
REDUCE_CHUNK = 1 << 20
MAX_SPANS = 1 << 16  # parts of one gathered frame, at most
WRITE_BACK = 1  # in the slot byte of a single-copy frame: reduce it, then write the result back
WRITE_APART = 2  # ... and write the result at the address that follows the header instead
DEST = struct.Struct("=Q")  # that address
ACK = b"\x06"
WRITE_BACK_MIN = 256 << 10  # an isend_reduce frame above this is written back (docs/shm.md)
MAX_IOV = 512  # pieces of one sendmsg, at most (the kernel's IOV_MAX is 1024)

def inline_frame(total: int, views: list[memoryview]) -> list[bytes | memoryview]:
    """An inline frame as the pieces of one ``sendmsg``: the header, then the payload (joined
    into one piece when it has more parts than a system call takes)."""
    head = HEADER.pack(EAGER, 0, total, total, 0)
    return [head, *views] if len(views) < MAX_IOV else [head, b"".join(views)]


def tally_frame(path: int, way: int, nbytes: int, copied: int) -> None:
    """Count a frame's bytes (:mod:`hora.transport.tally`)."""
    counts = tally.counts
    counts[path + way] += nbytes
    counts[path + tally.COPIED] += copied


def as_bytes(arr: np.ndarray) -> memoryview:
    """The memory of ``arr`` (C-contiguous) as a flat byte view, without copying."""
    return memoryview(arr).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
