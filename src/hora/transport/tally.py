"""What this process's collectives move: bytes sent, received and copied per path, and reduced.

Counted, not timed, so the figures mean the same on a loaded machine as on an idle one, and an
algorithm's traffic can be checked against the bandwidth-optimal bound (``hora bench
allreduce`` prints them; unit tests assert them exactly). Each count is one integer add per
message or piece, on the DATA channel only (the engine's negotiation is not counted).

Paths: ``inline`` (a shared-memory frame carried inside its socket), ``single copy`` (read
from or written into the peer's memory with ``process_vm_readv``/``writev``), ``staged``
(through a shared staging area), ``tcp`` and ``mapped`` (loads and stores on another member's
buffer in a shared arena). Per path:

* ``sent``: payload bytes of this rank's frames to its peers (for ``mapped``, bytes this rank
  writes into other members' buffers; for a single-copy frame that the peer reduces and writes
  back, the written-back bytes count as the peer's sent and this rank's received);
* ``received``: payload bytes of the peers' frames that reach this rank's buffers (for
  ``mapped``, bytes this rank reads from other members' buffers);
* ``copied``: bytes this rank copies to move them, itself or through the kernel: a socket's
  write and read, a single-copy read or write, a copy into or out of a staging slot or an
  arena. A reduction that reads a frame where it lies copies nothing.

``reduced`` counts the incoming bytes every reduction of this process folds in.

The counts are process-wide and never reset by hora; readers take :func:`snapshot` before and
after what they measure. Plain integer adds from several threads may in principle lose an
update; the transports count from the thread that moves the data, one at a time per pair.
"""

from __future__ import annotations

PATHS = ("inline", "single copy", "staged", "tcp", "mapped")
WAYS = ("sent", "received", "copied")
INLINE, SINGLE_COPY, STAGED, TCP, MAPPED = (3 * i for i in range(len(PATHS)))
SENT, RECEIVED, COPIED = range(len(WAYS))
REDUCED = 3 * len(PATHS)
IGNORED = REDUCED + 1  # a path where uncounted channels add (no branch on the hot path)

counts = [0] * (IGNORED + len(WAYS))  # index: path + way, REDUCED, IGNORED + way


def snapshot() -> dict[str, int]:
    """The counts now, as ``{"<path> <way>": bytes, ..., "reduced": bytes}``."""
    out = {f"{p} {w}": counts[3 * i + j] for i, p in enumerate(PATHS) for j, w in enumerate(WAYS)}
    out["reduced"] = counts[REDUCED]
    return out


def since(before: dict[str, int]) -> dict[str, int]:
    """What was counted since ``before`` (a :func:`snapshot`), leaving out zeros."""
    now = snapshot()
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def totals(moved: dict[str, int]) -> dict[str, int]:
    """``sent``, ``received`` and ``copied`` over every path of ``moved`` (a :func:`since`),
    and ``reduced``."""
    out = {w: sum(moved.get(f"{p} {w}", 0) for p in PATHS) for w in WAYS}
    out["reduced"] = moved.get("reduced", 0)
    return out
