"""Point-to-point messages on NumPy arrays: ``send_async`` and ``recv_async``.

The op surface's face of :mod:`hora.core.p2p`: it checks the arguments in the caller's thread
(the peer a global rank of the set other than this one, the tag an int, the array contiguous
and, to receive into, writable) and hands the array's bytes to this rank's mailbox. Messages
travel on connections of their own, never through the engine. A message matches a receive by
sender, process set and tag (a receive with ``src=None`` takes the set's first message with
its tag, from any sender); a receive of another dtype or size fails on both ranks. Handles
complete when the receiver has the message; a receive's ``synchronize`` returns the sender's
global rank, a send's None. Thread-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.core import runtime as _rt
from hora.core.handles import Handle
from hora.core.p2p import mailbox
from hora.core.process_sets import ProcessSet, resolve
from hora.frameworks.submit import _array, _set_id

_INTS = (int, np.integer)


def _checked(what: str, peer: int | None, tag: int,
             process_set: ProcessSet | None) -> tuple[int, tuple[int, ...]]:  # fmt: skip
    """The set's id and its ranks other than this one; ``peer`` None: any of them."""
    ps_id = _set_id(process_set)
    ranks = resolve(process_set).ranks
    me = _rt.runtime().identity.rank
    if isinstance(tag, bool) or not isinstance(tag, _INTS):
        raise TypeError(f"{what}: tag must be an int, got {tag!r}")
    if me not in ranks:
        raise ValueError(f"{what}: rank {me} is not in the process set {ranks}")
    others = tuple(r for r in ranks if r != me)
    if peer is None:
        if not others:
            raise ValueError(f"{what}: no other rank in the process set {ranks}")
        return ps_id, others
    if isinstance(peer, bool) or not isinstance(peer, _INTS) or int(peer) not in ranks:
        raise ValueError(f"{what}: rank {peer!r} is not a global rank of the process set {ranks}")
    if int(peer) == me:
        raise ValueError(f"{what}: rank {me} cannot exchange a message with itself")
    return ps_id, others


def send_async(
    array: Any,
    dst: int,
    *,
    tag: int = 0,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
) -> Handle:
    """Send ``array`` to global rank ``dst``; keep it unchanged until the handle is done."""
    ps_id, _ = _checked("send", dst, tag, process_set)
    arr, dt, _ = _array(array, dtype)
    return mailbox().send(int(dst), ps_id, int(tag), arr.data.cast("B"), dt)


def recv_async(
    array: Any,
    src: int | None,
    *,
    tag: int = 0,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
) -> Handle:
    """Receive the next message from global rank ``src`` (None: any other rank of the set)
    with ``tag`` into ``array``; the handle gives the sender's global rank."""
    ps_id, others = _checked("recv", src, tag, process_set)
    arr, dt, _ = _array(array, dtype)
    if not arr.flags.writeable:
        raise ValueError("recv: the array to receive into is read-only")
    if src is None:
        return mailbox().recv(None, ps_id, int(tag), arr.data.cast("B"), dt, others)
    return mailbox().recv(int(src), ps_id, int(tag), arr.data.cast("B"), dt)
