"""The scaling lab's ``--compression`` and ``--ddp-hook`` axes: names to compressors and hooks.

``none``, ``fp16``, ``bf16``, ``powersgd`` (rank 4), ``powersgd-r<R>`` (rank R), ``topk``
(1%), ``topk-<P>`` (P percent) name what ``hora.torch.DistributedOptimizer(compression=...)``
gets; the lab's DDP peer takes ``--ddp-hook powersgd`` (or ``powersgd-r<R>``): torch's own
PowerSGD communication hook at that rank. PowerSGD starts compressing after ``START_ITER``
steps of exact averaging in both, so that a short benchmark times the compressed steps.
Pure functions; run in each rank (and in the lab's process to check names early).
"""

from __future__ import annotations

import re
from typing import Any

START_ITER = 2
NAMES = ("none", "fp16", "bf16", "powersgd", "powersgd-r<R>", "topk", "topk-<percent>")
_FORM = re.compile(r"^(none|fp16|bf16|powersgd(?:-r(\d+))?|topk(?:-(\d+(?:\.\d+)?))?)$")


def check(name: str) -> str:
    """``name`` if it names a compression, else ValueError listing the names."""
    if not _FORM.match(name):
        raise ValueError(f"compression {name!r}: choose from {', '.join(NAMES)}")
    return name


def parse_list(text: str) -> list[str]:
    """``"none,powersgd-r1"`` -> checked names, in order, without repeats."""
    names = [check(p.strip().lower()) for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("--compression: give at least one of " + ", ".join(NAMES))
    return list(dict.fromkeys(names))


def powersgd_rank(name: str) -> int:
    m = _FORM.match(name)
    return int(m.group(2)) if m and m.group(2) else 4


def make(name: str, hvd: Any) -> Any:
    """What ``DistributedOptimizer(compression=)`` gets for ``name`` (``hvd``: hora.torch)."""
    m = _FORM.match(check(name))
    assert m is not None
    if name.startswith("powersgd"):
        return hvd.Compression.powersgd(rank=powersgd_rank(name), start_iter=START_ITER)
    if name.startswith("topk"):
        return hvd.Compression.topk(ratio=float(m.group(3) or 1.0) / 100.0)
    return getattr(hvd.Compression, name)


def register_ddp_hook(model: Any, hook: str) -> None:
    """torch's PowerSGD hook on a DistributedDataParallel ``model`` (``hook``: powersgd[-rR])."""
    if not hook.startswith("powersgd") or check(hook) != hook:
        raise ValueError(f"--ddp-hook {hook!r}: choose powersgd or powersgd-r<R>")
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank(hook),
                               start_powerSGD_iter=START_ITER)  # fmt: skip
    model.register_comm_hook(state, psgd.powerSGD_hook)
