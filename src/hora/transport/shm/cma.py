"""Single-copy reads and writes of another process's memory (Linux cross-memory attach).

A receiver that may read its peer's memory copies a payload straight from the sender's buffer
into its own: one copy, no staging. The kernel allows it when the reader could ptrace the
target (same user, and Yama's ``ptrace_scope`` at 0, or the target allowed it); a container's
seccomp profile may forbid the call outright. :func:`readable` tells, per peer, by reading a
probe buffer whose content the peer sent beside its address. The same check allows
``process_vm_writev`` (:func:`transfer` with ``write``), with which a rank that reduced a
peer's block writes the result straight back into the peer's buffer.

The call goes through ``ctypes``, which releases the GIL for its duration. Pure functions;
thread-safe.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from array import array
from collections.abc import Iterator

import numpy as np

log = logging.getLogger(__name__)

# A ``struct iovec`` array is built as a flat array of machine words, (base, len) per piece:
# one C-level constructor call instead of a ctypes object per piece.
_WORD = "Q" if ctypes.sizeof(ctypes.c_void_p) == 8 else "L"


def _load(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    # the iovec arrays go as addresses (see _WORD)
    func.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    func.restype = ctypes.c_ssize_t
    return func


_READV = _load("process_vm_readv")
_WRITEV = _load("process_vm_writev")


def supported() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (Linux with a C library)."""
    return _READV is not None


def address(view: memoryview) -> int:
    """The address of the first byte of a contiguous byte view (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def read(pid: int, dst: memoryview, src_addr: int) -> None:
    """Copy ``dst.nbytes`` bytes at ``src_addr`` in process ``pid`` into ``dst``.

    Raises OSError (``ESRCH`` once the process is gone, ``EPERM``/``EFAULT``/``ENOSYS``
    when the read is not allowed or the address is not mapped).
    """
    read_to(pid, address(dst), dst.nbytes, src_addr)


def read_to(pid: int, base: int, total: int, src_addr: int) -> None:
    """:func:`read` into the ``total`` bytes at address ``base`` of this process."""
    if _READV is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    done = 0
    while done < total:
        local = array(_WORD, (base + done, total - done))
        remote = array(_WORD, (src_addr + done, total - done))
        got = _READV(pid, local.buffer_info()[0], 1, remote.buffer_info()[0], 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got


Span = tuple[int, int]  # (address, bytes)

_IOV_BATCH = 512  # pieces per system call (the kernel takes up to IOV_MAX = 1024)


def steps(
    local: list[Span], remote: list[Span], step: int
) -> Iterator[list[tuple[int, int, int, int]]]:
    """Two scatter lists of equal total (spans here, spans in the other process), cut into steps
    of ``step`` bytes (the last one shorter): each step is the list of its pieces contiguous on
    both sides, in order, as ``(local span index, offset in it, remote address, bytes)``."""
    i = j = lo = ro = 0  # lo / ro: bytes already used of local[i] / remote[j]
    pieces: list[tuple[int, int, int, int]] = []
    left = step
    while i < len(local) and j < len(remote):
        (_, ln), (ra, rn) = local[i], remote[j]
        n = min(ln - lo, rn - ro, left)
        if n:
            pieces.append((i, lo, ra + ro, n))
        lo, ro, left = lo + n, ro + n, left - n
        if lo == ln:
            i, lo = i + 1, 0
        if ro == rn:
            j, ro = j + 1, 0
        if not left:
            yield pieces
            pieces, left = [], step
    if pieces:
        yield pieces


def matched(local: list[Span], remote: list[Span]) -> list[tuple[int, int, int]]:
    """Cut two scatter lists of equal total into pieces contiguous on both sides:
    ``(local address, remote address, bytes)``, in order (:func:`steps` in one step)."""
    total = sum(n for _, n in local)
    return [
        (local[i][0] + off, there, n)
        for pieces in steps(local, remote, max(total, 1))
        for i, off, there, n in pieces
    ]


def read_spans(pid: int, local: list[Span], remote: list[Span]) -> None:
    """Copy the bytes of ``remote`` (spans in process ``pid``) into ``local`` (spans here),
    in order: a gather on the other side and a scatter on this one, with no staging copy."""
    if len(local) == 1 and len(remote) == 1:
        read_to(pid, local[0][0], local[0][1], remote[0][0])
        return
    transfer(pid, matched(local, remote))


def transfer(pid: int, pieces: list[tuple[int, int, int]], write: bool = False) -> None:
    """Copy each ``(local address, remote address, bytes)`` piece from process ``pid`` here,
    or with ``write`` from here into process ``pid``, batching pieces into few system calls."""
    func, what = (_WRITEV, "process_vm_writev") if write else (_READV, "process_vm_readv")
    if func is None:
        raise OSError(errno.ENOSYS, f"{what} is not available on this platform")
    k = 0
    while k < len(pieces):
        batch = pieces[k : k + _IOV_BATCH]
        loc = array(_WORD, [x for a, _, n in batch for x in (a, n)])
        rem = array(_WORD, [x for _, r, n in batch for x in (r, n)])
        got = func(pid, loc.buffer_info()[0], len(batch), rem.buffer_info()[0], len(batch), 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"{what} with pid {pid}: {os.strerror(err)}")
        for a, r, n in batch:  # a short transfer stops inside one piece: resume there
            if got < n:
                pieces[k] = (a + got, r + got, n - got)
                break
            got -= n
            k += 1


def readable(pid: int, src_addr: int, expected: bytes) -> bool:
    """Whether ``expected`` can be read at ``src_addr`` in process ``pid`` (a probe)."""
    got = bytearray(len(expected))
    try:
        read(pid, memoryview(got), src_addr)
    except OSError as e:
        log.debug("single-copy reads from pid %d are not possible: %s", pid, e)
        return False
    return bytes(got) == expected
