"""A shared arena: memory that every member of a process set on one host maps.

Collectives that work on it (:mod:`hora.collectives.allreduce_mapped`) read and write the other
members' memory with plain loads and stores: no system call per piece, as a single-copy read
needs, and no staging copy. The engine packs a fused response straight into this rank's part
(it is the fusion buffer), so nothing is copied that was not copied before.

Each member creates an anonymous ``memfd`` of the arena's size (pages are allocated when first
written), keeps its descriptor open, and sends every other member its pid, descriptor number and
size over the set's pairs, with a random token it wrote at the start of its part; each member
opens the others' through ``/proc/<pid>/fd/<n>`` (the kernel allows it to the same user: a
ptrace *read* check, which Yama's ``ptrace_scope=1`` leaves alone, unlike the *attach* check of
single-copy reads), maps them and checks each token, so a pid that
names another process here (ranks in different pid namespaces) is caught. Then every member
tells every other whether it mapped them all, and the arena is used only if all did, so every
member decides alike. A memfd has no name: nothing is left behind on
any exit path, a SIGKILL included, and the kernel frees it when the last process unmaps it.
The size never changes once shared, so a mapping can never fault past its end.

A part begins with a head of its own (:data:`HEAD`): a page with the token, then a few words
that members set for one another with plain stores (:meth:`Arena.words`), then two mailboxes
(:meth:`Arena.mailboxes`, :mod:`hora.transport.shm.mailbox`); what callers lay out (the fusion
buffer, exchange slots) begins after it, still page-aligned.

:func:`open_arena` is collective (every member calls it at the same point of the set's order,
as the collectives do); an :class:`Arena` is then used by the engine thread only.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.transport.base import Pair

log = logging.getLogger(__name__)

# pid, descriptor number, bytes, the token at its start, whether the member's pairs to every
# other member read single-copy both ways, and whether its host has more ranks than cores
_HELLO = struct.Struct("<qqq16s??")
_PAGE = 4096  # the head's first page: the token, then the words
# bytes of each of a part's two mailboxes (Arena.mailboxes), after the page: a round's header
# with 64 KiB of inputs fits (hora.core.handover)
MAILBOX = (64 + 4) << 10
HEAD = _PAGE + 2 * MAILBOX  # each part's own head, before what callers lay out
_WORDS = 64  # the words' byte offset in the head (a cache line of their own)
WORDS = 8  # int64 words per part (Arena.words)
_OK, _NO = b"\x01", b"\x00"
# whether other cores see this process's plain stores in the order it made them, and it its
# loads in the order it made them (x86), so that a word set after data written says the data
# is there, and a word set after data read says the reads are done; elsewhere the words only
# carry what may be read late
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class Arena:
    """This rank's part of a set's shared memory and its mappings of the others' parts."""

    def __init__(self, fd: int, maps: list[mmap.mmap], rank: int, pulls: bool = True,
                 crowded: bool = False) -> None:  # fmt: skip
        self._fd = fd  # kept open: the others open the memory through it
        self._maps = maps
        self.rank = rank
        # every member's pairs to every other read single-copy both ways (the same on every
        # member); False where the kernel refuses such reads (Yama) or HORA_SHM_SINGLE_COPY=0
        self.pulls = pulls
        # some member said its host runs more ranks than it has cores (the same on every
        # member): ranks then wait for one another's turn on a core
        self.crowded = crowded
        self.nbytes = min(len(m) for m in maps) - HEAD
        whole = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self._words = [w[_WORDS : _WORDS + 8 * WORDS].view(np.int64) for w in whole]
        self._bytes = [w[HEAD:] for w in whole]
        self._boxes = [[w[_PAGE + k * MAILBOX : _PAGE + (k + 1) * MAILBOX] for w in whole]
                       for k in (0, 1)]  # fmt: skip
        self._region: tuple[Any, list[np.ndarray]] = (None, [])  # the last region's views
        self._base = int(self._bytes[rank].ctypes.data)

    def mine(self, count: int, dtype: np.dtype) -> np.ndarray:
        """The first ``count`` elements of this rank's part, as ``dtype``."""
        return self._bytes[self.rank][: count * dtype.itemsize].view(dtype)

    def region(self, offset: int, nbytes: int, dtype: np.dtype | None = None) -> list[np.ndarray]:
        """Bytes ``[offset, offset + nbytes)`` of every member's part (viewed as ``dtype``).
        The same list for the same region while it is the last one asked for (a loop of one
        allreduce asks for the same one every call); not to be changed."""
        key = (offset, nbytes, "" if dtype is None else np.dtype(dtype).str)  # (== None is
        # True of float64)
        if self._region[0] == key:
            return self._region[1]
        parts = [b[offset : offset + nbytes] for b in self._bytes]
        views = parts if dtype is None else [p.view(dtype) for p in parts]
        self._region = (key, views)
        return views

    def words(self) -> list[np.ndarray]:
        """Every member's :data:`WORDS` int64 words, by member, zero at first: what each tells
        the others between messages (each member writes only its own). A plain store, so only
        for what may be read late: a reader that does not see a word yet must be right to
        wait."""
        return self._words

    def mailboxes(self, which: int) -> list[np.ndarray]:
        """Every member's mailbox ``which`` (0 or 1) of :data:`MAILBOX` bytes, by member: where
        each writes what all the others read (each member writes only its own)."""
        return self._boxes[which]

    def views(self, like: np.ndarray) -> list[np.ndarray] | None:
        """Every member's part laid out as ``like``, a view at the start of this rank's part
        (what :meth:`mine` gave); None if ``like`` is not one."""
        if like.ndim != 1 or int(like.ctypes.data) != self._base or like.nbytes > self.nbytes:
            return None
        return self.region(0, like.nbytes, like.dtype)

    def close(self) -> None:
        """Unmap everything (views into the arena must be gone) and let the memory go."""
        maps, self._maps, self._bytes, self._words = self._maps, [], [], []
        self._region = (None, [])
        self._boxes = [[], []]
        for m in maps:
            with contextlib.suppress(BufferError):  # a view still held: unmapped with it
                m.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def open_arena(pairs: Sequence[Pair | None], rank: int, nbytes: int,
               crowded: bool = False) -> Arena | None:  # fmt: skip
    """Create this rank's part of ``nbytes`` (after its head) and map the others'
    (``pairs[i]``: the pair to member ``i``, None for this rank). Collective over the
    members; None on every member when any of them could not map all the parts (the reason
    is logged at debug level). ``crowded``: this host runs more ranks than it has cores
    (:attr:`Arena.crowded` is whether any member said so)."""
    fd = os.memfd_create("hora-arena", os.MFD_CLOEXEC)
    found: dict[int, mmap.mmap] = {}
    try:
        os.ftruncate(fd, HEAD + nbytes)
        found[rank] = mmap.mmap(fd, HEAD + nbytes)
        token = os.urandom(16)  # proves a mapping is this part, whatever the pid namespaces
        found[rank][: len(token)] = token
        others = [i for i, p in enumerate(pairs) if p is not None]
        pulls = all(getattr(pairs[i], "single_copy", False) for i in others)
        hello = _HELLO.pack(os.getpid(), fd, HEAD + nbytes, token, pulls, crowded)
        for i in others:
            _pair(pairs, i).send_msg(hello)
        problem = ""
        for i in others:
            pid, peer_fd, size, peer_token, peer_pulls, peer_crowded = _HELLO.unpack(
                _pair(pairs, i).recv_msg())
            pulls = pulls and peer_pulls
            crowded = crowded or peer_crowded
            if problem:
                continue
            try:
                found[i] = _map(pid, peer_fd, size)
            except OSError as e:
                problem = f"cannot map member {i}'s arena: {e}"
                continue
            # another pid namespace (a container) can make the pid name another process here
            if found[i][: len(peer_token)] != peer_token:
                problem = f"/proc/{pid}/fd/{peer_fd} is not member {i}'s arena here"
        for i in others:
            _pair(pairs, i).send_msg(_NO if problem else _OK)
        verdicts = [_pair(pairs, i).recv_msg() for i in others]
        if not problem and all(v == _OK for v in verdicts):
            return Arena(fd, [found[i] for i in range(len(pairs))], rank, pulls, crowded)
        log.debug("shared arena not used: %s", problem or "another member could not map it")
    except BaseException:
        _release(fd, list(found.values()))
        raise
    _release(fd, list(found.values()))
    return None


def _pair(pairs: Sequence[Pair | None], i: int) -> Pair:
    pair = pairs[i]
    assert pair is not None
    return pair


def _map(pid: int, fd: int, size: int) -> mmap.mmap:
    peer = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(peer).st_size != size:
            raise OSError(f"arena of {os.fstat(peer).st_size} bytes, {size} announced")
        return mmap.mmap(peer, size)
    finally:
        os.close(peer)


def _release(fd: int, maps: list[mmap.mmap]) -> None:
    for m in maps:
        m.close()
    with contextlib.suppress(OSError):
        os.close(fd)
