"""The staging area of one direction of a shared-memory pair, when single-copy reads are refused.

The sender copies a payload into one of ``SLOTS`` slots of ``SLOT_BYTES`` and tells the
receiver which; the receiver copies (or reduces) it out and acknowledges, which frees the slot.
The memory is an anonymous ``memfd`` whose descriptor travels to the peer over the pair's Unix
socket (``SCM_RIGHTS``): it has no name, so nothing can be left behind in ``/dev/shm`` on any
exit path, a SIGKILL included; the kernel frees it when the last of the two processes unmaps it.
Pages are only allocated when first written.

A Staging object is used by one sending thread and one receiving thread of one process each;
slots are handed over through the pair's frames and acknowledgements, never shared at once.
"""

from __future__ import annotations

import mmap
import os
import socket

import numpy as np

SLOT_BYTES = 2 << 20
SLOTS = 4


class Staging:
    """``SLOTS`` slots of ``SLOT_BYTES`` mapped from a memfd shared with the peer."""

    def __init__(self, fd: int) -> None:
        self.size = SLOTS * SLOT_BYTES
        self._map = mmap.mmap(fd, self.size)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, sock: socket.socket) -> Staging:
        """Make a new area and send its descriptor to the peer over ``sock``."""
        fd = os.memfd_create("hora-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            staging = cls(fd)
            socket.send_fds(sock, [b"F"], [fd])
        finally:
            os.close(fd)
        return staging

    @classmethod
    def receive(cls, sock: socket.socket) -> Staging:
        """Map the area whose descriptor the peer sends over ``sock``."""
        msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
        try:
            if msg != b"F" or len(fds) != 1:
                raise OSError(f"expected one staging descriptor, got {msg!r} with {len(fds)} fds")
            return cls(fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def slot(self, index: int, nbytes: int, dtype: np.dtype | None = None) -> np.ndarray:
        """The first ``nbytes`` of slot ``index``, as bytes or viewed as ``dtype``."""
        if not 0 <= index < SLOTS or not 0 <= nbytes <= SLOT_BYTES:
            raise ValueError(f"slot {index} of {nbytes} bytes is outside the staging area")
        start = index * SLOT_BYTES
        raw = self._bytes[start : start + nbytes]
        return raw if dtype is None else raw.view(dtype)


def available() -> bool:
    """Whether anonymous shared memory can be made here (Linux ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
