"""TensorFlow's start-up notes: which lines of a worker's stderr the launcher leaves out.

Importing TensorFlow prints notes on stderr before its logging is set up, so
``TF_CPP_MIN_LOG_LEVEL`` cannot hide them: absl's "All log messages before
absl::InitializeLog() ..." banner, the oneDNN note, "Could not find cuda drivers", the CPU
instruction note (two lines), and on a machine without a GPU driver an error-level
"failed call to cuInit". Unless the ``tf_logs`` knob is on (``hora run --tf-logs`` or
``HORA_TF_LOGS=1``), the launcher gives every worker ``TF_CPP_MIN_LOG_LEVEL=1`` when it is not
set (TensorFlow's INFO lines hidden; warnings and errors kept) and drops exactly these notes from
each worker's stderr (:class:`StartupNotes`, one per stream). The cuInit error is dropped only
after the same process said it found no CUDA driver: with a driver, it stays. Every other line
passes, and ``--output-filename`` files keep everything.

Pure functions and one small state machine per stream, used by that stream's pump thread.
"""

from __future__ import annotations

import re

TF_LOG_LEVEL = "1"  # TF_CPP_MIN_LOG_LEVEL given to workers by default: INFO hidden

ABSL_BANNER = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)
# I0000 00:00:1795720643.587812    6567 port.cc:153] message
_ABSL_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ ([\w.]+):\d+\] (.*)$", re.S)
# (severity, source file, start of the message) of the notes that are always dropped
_NOTES = (
    (b"I", b"port.cc", b"oneDNN custom operations are on."),
    (b"I", b"cudart_stub.cc", b"Could not find cuda drivers on your machine"),
    (b"I", b"cpu_feature_guard.cc", b"This TensorFlow binary is optimized to use available CPU"),
)
_CPU_NOTE_TAIL = b"To enable the following instructions:"
_NO_DRIVER = b"Could not find cuda drivers on your machine"
_CUINIT = b"failed call to cuInit"


class StartupNotes:
    """``drop(line)``: whether one line of a worker's stderr is a TensorFlow start-up note.

    ``line`` is the line as written, its terminator included or not.
    """

    def __init__(self) -> None:
        self.no_driver = False  # this process said it has no CUDA driver
        self._cpu_tail = False  # the CPU note's second line comes next

    def drop(self, line: bytes) -> bool:
        text = line.rstrip(b"\r\n")
        if self._cpu_tail:
            self._cpu_tail = False
            if text.startswith(_CPU_NOTE_TAIL):
                return True
        if text == ABSL_BANNER:
            return True
        m = _ABSL_LINE.match(text)
        if m is None:
            return False
        severity, source, message = m.groups()
        for sev, src, start in _NOTES:
            if severity == sev and source == src and message.startswith(start):
                if start.startswith(_NO_DRIVER):
                    self.no_driver = True
                if src == b"cpu_feature_guard.cc":
                    self._cpu_tail = True
                return True
        return severity == b"E" and self.no_driver and message.startswith(_CUINIT)


def worker_env_defaults(tf_logs: bool) -> dict[str, str]:
    """Variables every worker gets unless it has them already: none with ``tf_logs``."""
    return {} if tf_logs else {"TF_CPP_MIN_LOG_LEVEL": TF_LOG_LEVEL}
