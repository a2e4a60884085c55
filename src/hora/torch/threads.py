"""torch's intra-op thread pool, sized per rank at ``init()`` (:mod:`hora.core.runtime`'s hook).

Several ranks on one host each start a pool as large as the host: two ranks on two cores run
four busy threads on two cores, and each step waits for the slowest of them. When the user chose
no size (no ``OMP_NUM_THREADS``, no ``torch.set_num_threads()`` before ``hvd.init()``), each
rank's pool gets its share of the host's cores, as torchrun does (it gives one thread); an
elastic job's later rounds size it again. Runs in the thread that calls ``init()``.
"""

from __future__ import annotations

import os

import torch

from hora.core.placement import register_thread_hook

_set_here: int | None = None  # the size this hook gave the pool last


def _default() -> int:
    """The pool size torch picks by itself: the cores the process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_threads(share: int) -> tuple[int, bool]:
    """Give torch's pool ``share`` threads unless the user sized it; (its size, whether set)."""
    global _set_here
    now = torch.get_num_threads()
    chosen = "OMP_NUM_THREADS" in os.environ or now not in (_default(), _set_here)
    if chosen or now == share and _set_here is None and share == _default():
        return now, False
    if now != share:
        torch.set_num_threads(share)
    _set_here = share
    return share, True


register_thread_hook(share_threads)
