"""The stall inspector: tensors some ranks submitted and others did not.

Warned about every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` in Horovod's words, naming the ranks
that are missing; past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` the job ends with the same text.
Rank 0 knows who has not submitted what from its coordinator (:class:`StallInspector`, with the
hang report's stacks); a rank waiting in a direct-mode round knows whom it waits for
(:mod:`hora.core.fastpath`). Both word it with :data:`STALL_MESSAGE`, :func:`missing_line` and
:func:`shutdown_error`.

Runs in the thread doing the engine's work; not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from hora.errors import HoraInternalError
from hora.settings import Settings

log = logging.getLogger("hora.engine")

STALL_MESSAGE = (
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
    "ranks and are waiting for remainder of ranks for more than {secs:.0f} seconds. This may "
    "indicate that different ranks are trying to submit different tensors or that only subset "
    "of ranks is submitting tensors, which will cause deadlock.\nMissing ranks:\n{lines}"
)


def missing_line(rank: int, names: list[str]) -> str:
    """One line of the message: a missing rank and (the first six of) its tensors."""
    shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    return f"{rank}: [{shown}]"


def shutdown_error(text: str, settings: Settings) -> HoraInternalError:
    """The error that ends a job stalled past the shutdown time."""
    return HoraInternalError(
        text + f"\nStalled for more than {settings.stall_shutdown_time_seconds:.0f} seconds: "
        "shutting down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."
    )


class StallInspector:
    """Rank 0's inspector over its coordinator's waiting tensors, with the hang report."""

    def __init__(self, settings: Settings, coordinator: Any, hang: Any) -> None:
        self.settings = settings
        self.coordinator = coordinator
        self.hang = hang
        self._last_check = 0.0
        self._last_warn = 0.0

    def check(self) -> None:
        """At most every 0.5 s: warn, feed the hang report, or raise past the shutdown time."""
        s = self.settings
        if s.stall_check_disable:
            return
        now = time.monotonic()
        if now - self._last_check < 0.5:
            return
        self._last_check = now
        oldest = self.coordinator.oldest_wait(now)
        shut = 0 < s.stall_shutdown_time_seconds <= oldest
        warn = oldest >= s.stall_check_time_seconds and now - self._last_warn >= (
            s.stall_check_time_seconds
        )
        after = min(s.stall_check_time_seconds, s.stall_shutdown_time_seconds or float("inf"))
        if self._hang_pending(oldest, now, shut, after):
            return
        if not (shut or warn):
            return
        lines = self.coordinator.stalled(after, now)
        text = STALL_MESSAGE.format(secs=after, lines="\n".join(lines))
        if shut and self.hang.text:
            text += "\n" + self.hang.text
        if shut:
            raise shutdown_error(text, s)
        self._last_warn = now
        log.warning(text)

    def _hang_pending(self, oldest: float, now: float, shut: bool, after: float) -> bool:
        """Feed the hang report; True while a stall shutdown waits for its stacks."""
        if oldest < after:
            self.hang.reset()
            return False
        return not self.hang.poll(self.coordinator, after, now) and shut


def round_stall(
    s: Settings, held: Iterable[str], missing: list[int], since: float, warned: float | None
) -> float | None:
    """The stall inspector of a direct-mode round, waiting since ``since`` for the ranks
    ``missing`` while this rank holds the tensors named ``held`` (read only once it warns):
    warns every HOROVOD_STALL_CHECK_TIME_SECONDS, ends the job past the shutdown time.
    Returns when it last warned."""
    now = time.monotonic()
    if s.stall_check_disable or now - since < s.stall_check_time_seconds:
        return warned
    names = list(held)
    lines = "\n".join(missing_line(r, names) for r in missing)
    text = STALL_MESSAGE.format(secs=s.stall_check_time_seconds, lines=lines)
    if 0 < s.stall_shutdown_time_seconds <= now - since:
        raise shutdown_error(text, s)
    if warned is None or now - warned >= s.stall_check_time_seconds:
        log.warning(text)
        return now
    return warned
