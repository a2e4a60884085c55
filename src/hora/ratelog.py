"""Warnings that cannot flood the log: the first few as they come, then one summary with a count.

A :class:`RateLimitedLog` wraps a logger for one kind of repeated warning (for example "a
connection was rejected"). In each window of ``every`` seconds the first ``first`` warnings are
logged as they come; the rest are counted, and when the window ends one line says how many were
left out (with the last of them as an example). While warnings keep coming, each later window
logs only that summary line; after a window with nothing left out, the next warning opens a fresh
window. The summary is written on the next warning or :meth:`flush` after the window ends, so an
owner with a periodic tick (the listener's accept loop) calls :meth:`flush` on it.

Pure Python, no threads of its own; every method is thread-safe. Safe to import from anywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

FIRST = 3
EVERY_S = 10.0


class RateLimitedLog:
    """Rate-limited ``warning`` for one kind of message on ``logger``."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        first: int = FIRST,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._what = what  # names the kind in the summary line ("rejected connections")
        self._first = first
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._start: float | None = None  # start of the current window; None: no window
        self._shown = 0  # warnings logged in full in the current window
        self._left_out = 0  # warnings counted, not logged, in the current window
        self._example = ""

    def warning(self, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless this window already showed its first few (then count it)."""
        now = self._clock()
        with self._lock:
            summary = self._roll(now)
            if self._start is None:
                self._start, self._shown, self._left_out = now, 0, 0
            show = self._shown < self._first
            if show:
                self._shown += 1
            else:
                self._left_out += 1
                self._example = msg % args if args else msg
        if summary:
            self._log.warning(summary)
        if show:
            self._log.warning(msg, *args)

    def flush(self, final: bool = False) -> None:
        """Write the summary of a window that has ended (with ``final``: of the current window,
        as its owner closes), if it left anything out."""
        now = self._clock()
        with self._lock:
            summary = self._roll(now, final)
        if summary:
            self._log.warning(summary)

    def next_due(self) -> float | None:
        """When (on the clock) :meth:`flush` next has something to write; None: nothing."""
        with self._lock:
            if self._start is None or not self._left_out:
                return None
            return self._start + self._every

    def _roll(self, now: float, final: bool = False) -> str:
        """End the window if its time is up; the summary line to write (or ""). Lock held."""
        if self._start is None or (now - self._start < self._every and not final):
            return ""
        if not self._left_out:
            self._start = None  # a quiet window: the next warning starts afresh
            return ""
        span = max(now - self._start, 1.0)
        text = (
            f"{self._left_out} more {self._what} in the last {span:.0f} s, not logged one by one "
            f"(the last: {self._example})"
        )
        # still flooding: the next window shows only its summary
        self._start, self._shown, self._left_out = now, self._first, 0
        return text
