"""The one-shot hang report: when the stall inspector fires, say who is stuck, and where.

When tensors have waited longer than ``HOROVOD_STALL_CHECK_TIME_SECONDS`` for some ranks, rank 0
asks each missing rank's engine thread for the current Python stack of every other thread of
that process (a ``stack`` control message; the engine thread answers with ``stacks``, taken with
``sys._current_frames``, so the user's code needs no cooperation: only hora's own engine thread
must be alive, which it is whenever the rank's control connection is). Once every missing rank
answered, or after :data:`ANSWER_WAIT` seconds, rank 0 logs one report:

    hora hang report: 1 operation(s) waiting for more than 60 s.
    allreduce.grad.fc1 (ALLREDUCE, process set 0): submitted by ranks [0, 2], not by [1]
    rank 1 (has not submitted 1 of them): Python stack of each thread
      Thread MainThread:
        File "train.py", line 42, in train
          loader_step()
        ...

It is logged once per stall (a new report only after the waits cleared). With
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` the engine ends the job with the report appended to its
error, so every rank's pending operations fail with it.

Runs in engine threads: :class:`HangReport` in rank 0's, :func:`stacks_message` in any rank's.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hora.engine")

ANSWER_WAIT = 5.0  # seconds rank 0 waits for the missing ranks' stacks
_MAX_FRAMES = 12  # innermost frames shown per thread


def thread_stacks(skip: int | None = None) -> str:
    """The current Python stack of every thread of this process but ``skip`` (a thread ident)
    and hora's own (``hora-*``: accept loops, the timeline writer), the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda i: (names.get(i) != "MainThread", str(names.get(i, i))))
    parts, hidden = [], 0
    for ident in order:
        name = str(names.get(ident, ident))
        if ident == skip or name.startswith("hora-"):
            hidden += ident != skip
            continue
        stack = traceback.format_stack(frames[ident])[-_MAX_FRAMES:]
        parts.append(f"Thread {name}:\n" + "".join(stack).rstrip("\n"))
    if hidden:
        parts.append(f"({hidden} of hora's own threads not shown)")
    return "\n".join(parts) if parts else "(no Python thread besides hora's)"


def stacks_message(rank: int, engine: threading.Thread) -> dict[str, Any]:
    """A missing rank's answer to ``stack``: its threads' stacks, the engine thread left out."""
    return {"t": "stacks", "rank": rank, "text": thread_stacks(engine.ident)}


def waiting(
    coordinator: Any, after: float, now: float
) -> list[tuple[str, str, int, list[int], list[int]]]:
    """(tensor name, op, process set, ranks that submitted, ranks that did not) per tensor that
    has waited ``after`` seconds or more; read from the coordinator's tables."""
    out = []
    for st in coordinator.sets.values():
        for pend in st.table.values():
            if now - pend.first_seen < after or not pend.requests:
                continue
            req = next(iter(pend.requests.values()))
            have = sorted(st.ranks[r] for r in pend.requests)
            missing = [
                st.ranks[r] for r in range(st.size) if r not in pend.requests and r not in st.joined
            ]
            out.append((req.name, req.op.name, st.ps_id, have, missing))
    return out


class HangReport:
    """Rank 0's side: ask, collect, log once. ``send(rank, message)`` reaches a rank's engine."""

    def __init__(
        self, engine_thread: threading.Thread, send: Callable[[int, dict[str, Any]], None]
    ) -> None:
        self._engine = engine_thread
        self._send = send
        self._waits: list[tuple[str, str, int, list[int], list[int]]] = []
        self._stacks: dict[int, str] = {}
        self._asked: set[int] = set()
        self._deadline = 0.0
        self.text = ""  # the last complete report
        self.done = False

    @property
    def collecting(self) -> bool:
        return bool(self._asked) and not self.done

    def reset(self) -> None:
        """The waits cleared: the next stall gets a report of its own."""
        self._waits, self._stacks, self._asked = [], {}, set()
        self.done = False

    def poll(self, coordinator: Any, after: float, now: float) -> bool:
        """Called on each stall check while something waits ``after`` seconds; True once the
        report is complete (logged at that moment, once)."""
        if self.done:
            return True
        if not self._asked:
            self._waits = waiting(coordinator, after, now)
            missing = sorted({r for *_, m in self._waits for r in m})
            if not missing:
                return False
            self._asked = set(missing)
            self._deadline = now + ANSWER_WAIT
            for r in missing:
                if r == 0:
                    self._stacks[0] = thread_stacks(self._engine.ident)
                else:
                    try:
                        self._send(r, {"t": "stack"})
                    except Exception as e:  # a dead rank is reported as such
                        self._stacks[r] = f"(could not ask: {e})"
        if self._asked - set(self._stacks) and now < self._deadline:
            return False
        self.text = self._format(after)
        self.done = True
        log.warning(self.text)
        return True

    def add(self, rank: int, text: str) -> None:
        """A missing rank's ``stacks`` answer (rank 0's engine thread)."""
        if rank in self._asked:
            self._stacks[rank] = text

    def _format(self, after: float) -> str:
        lines = [
            f"hora hang report: {len(self._waits)} operation(s) waiting for more than "
            f"{after:.0f} s."
        ]
        for name, op, ps, have, missing in self._waits:
            lines.append(
                f"{name} ({op}, process set {ps}): submitted by ranks {have}, not by {missing}"
            )
        for r in sorted(self._asked):
            n = sum(1 for *_, m in self._waits if r in m)
            stack = self._stacks.get(
                r,
                f"(no answer within {ANSWER_WAIT:.0f} s: its engine thread is blocked too, "
                "e.g. by C code holding the GIL, or the process is gone)",
            )
            body = "\n".join("  " + ln for ln in stack.splitlines())
            lines.append(
                f"rank {r} (has not submitted {n} of them): Python stack of each thread\n{body}"
            )
        return "\n".join(lines)
