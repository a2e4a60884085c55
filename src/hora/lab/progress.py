"""The scaling lab's progress display: a bar redrawn on a terminal while a configuration trains
(fed by polling rank 0's progress file, which :mod:`hora.lab.train_worker` rewrites after every
step) and one line per finished configuration.

Thread use: :func:`poll` runs in a daemon thread and calls :meth:`Progress.step`; everything else
is called from the caller's thread. A lock keeps the lines whole.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TextIO


class Progress:
    """The progress bar (a redrawn line on a terminal) and one line per finished configuration.

    ``step`` is called from the polling thread, the rest from the caller's; a lock keeps lines
    whole.
    """

    def __init__(self, stream: TextIO, total: int) -> None:
        self.stream, self.total, self.done = stream, total, 0
        self.tty = stream.isatty()
        self.current = ""
        self._lock = threading.Lock()

    def _bar(self, fraction: float) -> str:
        filled = int(24 * fraction)
        return "[" + "#" * filled + "." * (24 - filled) + "]"

    def start(self, what: str) -> None:
        with self._lock:
            self.current = what
            self._draw(f"starting ({self.done + 1}/{self.total})")

    def step(self, done: int, total: int) -> None:
        with self._lock:
            self._draw(f"step {done}/{total}", done / total)

    def _draw(self, status: str, within: float = 0.0) -> None:
        if self.tty:
            bar = self._bar((self.done + within) / self.total)
            text = f"{bar} {self.done}/{self.total} {self.current}: {status}"
            self.stream.write("\r" + text[:150] + "\x1b[K")
            self.stream.flush()

    def line(self, text: str, finished: bool = True) -> None:
        with self._lock:
            self.done += finished
            prefix = f"[{self.done}/{self.total}] " if finished else ""
            self.stream.write(("\r\x1b[K" if self.tty else "") + prefix + text + "\n")
            self.stream.flush()


def read_progress(path: str) -> tuple[int, int] | None:
    """(steps done, steps in all) from rank 0's progress file; None before it is written."""
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            done, total = map(int, f.read().split())
        return done, total
    return None


def poll(path: str, progress: Progress, stop: threading.Event) -> None:
    while not stop.wait(0.3):
        found = read_progress(path)
        if found is not None:
            progress.step(*found)


def timed(path: str, warmup: int) -> bool:
    """Whether the timed steps have begun and not ended (rank 0's progress file says so)."""
    found = read_progress(path)
    return found is not None and warmup <= found[0] < found[1]
