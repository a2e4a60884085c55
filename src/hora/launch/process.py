"""Worker processes: spawning, output prefixing, and stopping them without leaving orphans.

Every worker, local or remote, runs under the same small POSIX-shell wrapper
(:func:`wrapper_script`). The wrapper reads the job secret from its stdin (so it never appears
on a command line), starts the command with ``setsid`` in a process group of its own, and keeps
reading stdin: when stdin reaches end-of-file (the launcher closed it to stop the worker, or the
launcher died, or the ssh connection dropped) it sends SIGTERM to the worker's process group, and
SIGKILL after a grace period. Locally the wrapper is started with ``/bin/sh -c``; remotely ``ssh``
runs it, and the same end-of-file travels over the ssh channel, so no tty is needed.

Output lines are split on ``\\n`` and ``\\r`` and prefixed ``[<rank>]<stdout>:`` or
``[<rank>]<stderr>:`` (optionally after a timestamp) by :class:`LinePrefixer`; with ``quiet``,
TensorFlow's start-up notes are left out of stderr (:mod:`hora.launch.quiet`).

Threads: :class:`Worker` starts two pump threads (stdout, stderr) and one waiter thread per
worker; the console sink is shared and guarded by a lock. ``stop()`` may be called from any
thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from io import TextIOBase
from typing import IO, Any, BinaryIO, TextIO

from hora.launch.quiet import StartupNotes

TIMESTAMP_FORMAT = "%a %b %d %H:%M:%S %Y"


def wrapper_script(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    grace_seconds: float = 5.0,
) -> str:
    """The POSIX-shell program that runs ``command`` as a stoppable worker.

    ``env`` entries are passed with ``env NAME=value`` (used over ssh, where the remote shell
    does not inherit the launcher's environment); ``cwd`` is entered first when given.
    """
    steps = int(max(grace_seconds, 0.0) * 5) + 1
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in (env or {}).items())
    run = "env " + assignments + " " if assignments else ""
    lines = [
        f"cd {shlex.quote(cwd)} >/dev/null 2>&1" if cwd else ":",
        "IFS= read -r HORA_SECRET_KEY || exit 125",
        "export HORA_SECRET_KEY",
        f"setsid {run}{shlex.join(command)} </dev/null &",
        "pid=$!",
        # The watcher: end-of-file on stdin stops the worker's whole process group.
        # (A background list's stdin is /dev/null unless redirected explicitly: hence fd 3.)
        "exec 3<&0",
        "( while IFS= read -r _; do :; done; kill -TERM -$pid 2>/dev/null; n=0;"
        f" while kill -0 -$pid 2>/dev/null && [ $n -lt {steps} ]; do sleep 0.2; n=$((n+1));"
        " done; kill -KILL -$pid 2>/dev/null ) <&3 &",
        "watcher=$!",
        "wait $pid 2>/dev/null",
        "rc=$?",
        "kill $watcher 2>/dev/null",
        "exit $rc",
    ]
    return "\n".join(lines)


class LinePrefixer:
    """Cuts a byte stream into lines (ending in ``\\n``, ``\\r`` or ``\\r\\n``) and prefixes each.

    ``feed`` may receive arbitrary chunks; a line is written once its terminator arrives, and
    ``close`` writes any unterminated rest. Used by one pump thread; not thread-safe itself.
    """

    def __init__(
        self,
        prefix: bytes,
        write: Callable[[bytes], None],
        timestamp: bool = False,
        drop: Callable[[bytes], bool] | None = None,
    ):
        self._drop = drop  # lines it says yes to are not written
        self._prefix = prefix
        self._write = write
        self._timestamp = timestamp
        self._pending = b""
        self._after_cr = False

    def _emit(self, line: bytes) -> None:
        if self._drop is not None and self._drop(line):
            return
        head = self._prefix
        if self._timestamp:
            head = time.strftime(TIMESTAMP_FORMAT).encode() + head
        self._write(head + line)

    def feed(self, data: bytes) -> None:
        start = 0
        for i, byte in enumerate(data):
            if self._after_cr:
                self._after_cr = False
                if byte == 0x0A:  # the \n of a \r\n already emitted with the \r
                    start = i + 1
                    continue
            if byte in (0x0A, 0x0D):
                terminator = b"\n" if byte == 0x0A else b"\r"
                self._emit(self._pending + data[start:i] + terminator)
                self._pending = b""
                start = i + 1
                self._after_cr = byte == 0x0D
        self._pending += data[start:]

    def close(self) -> None:
        if self._pending:
            self._emit(self._pending + b"\n")
            self._pending = b""


class ConsoleSink:
    """Serialises whole lines from many pump threads onto one stream.

    A text stream without a binary ``buffer`` (a notebook's ``sys.stdout``) gets decoded text.
    """

    def __init__(self, stream: TextIO | BinaryIO):
        binary = getattr(stream, "buffer", None)
        if binary is None and not isinstance(stream, TextIOBase):
            binary = stream
        self._binary: BinaryIO | None = binary
        self._text: Any = stream
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._binary is not None:
                self._text.flush()
                self._binary.write(data)
                self._binary.flush()
            else:
                self._text.write(data.decode(errors="replace"))
                self._text.flush()


class Worker:
    """One worker process (a local wrapper shell, an ssh session, or mpirun).

    ``exits`` receives ``(label, returncode)`` once the process has exited and its output has
    been fully written.
    """

    def __init__(
        self,
        label: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        cwd: str | None,
        stdin_data: bytes | None,
        stdout: ConsoleSink,
        stderr: ConsoleSink,
        exits: queue.Queue[tuple[int, int]],
        prefix: bool = True,
        timestamp: bool = False,
        output_dir: str | None = None,
        quiet: bool = False,
    ):
        self.label = label
        self._quiet = quiet
        self._stdin_data = stdin_data
        self._exits = exits
        self.proc = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if self.proc.stdin is not None and stdin_data is not None:
            try:
                self.proc.stdin.write(stdin_data)
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
        self._pumps = [
            self._pump(self.proc.stdout, "stdout", stdout, prefix, timestamp, output_dir),
            self._pump(self.proc.stderr, "stderr", stderr, prefix, timestamp, output_dir),
        ]
        threading.Thread(target=self._wait, name=f"hora-wait-{label}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(
        self,
        pipe: IO[bytes] | None,
        name: str,
        sink: ConsoleSink,
        prefix: bool,
        timestamp: bool,
        output_dir: str | None,
    ) -> threading.Thread:
        assert pipe is not None
        files: list[BinaryIO] = []
        if output_dir is not None:
            os.makedirs(output_dir, exist_ok=True)
            files.append(open(os.path.join(output_dir, name), "wb"))  # noqa: SIM115

        def write_console(data: bytes) -> None:
            sink.write(data)

        if prefix:
            tag = f"[{self.label}]<{name}>:".encode()
            drop = StartupNotes().drop if self._quiet and name == "stderr" else None
            cutter: LinePrefixer | None = LinePrefixer(tag, write_console, timestamp, drop)
        else:
            cutter = None

        def run() -> None:
            try:
                while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
                    for f in files:
                        f.write(chunk)
                        f.flush()
                    if cutter is not None:
                        cutter.feed(chunk)
                    else:
                        write_console(chunk)
                if cutter is not None:
                    cutter.close()
            finally:
                for f in files:
                    f.close()
                pipe.close()

        thread = threading.Thread(target=run, name=f"hora-{name}-{self.label}", daemon=True)
        thread.start()
        return thread

    def _wait(self) -> None:
        code = self.proc.wait()
        for pump in self._pumps:
            pump.join(timeout=10.0)
        self._exits.put((self.label, code))

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """Ask the worker to stop: end-of-file on its stdin, or SIGTERM for mpirun."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        else:  # mpirun: signal it directly; it forwards to its ranks
            self._signal(signal.SIGTERM)

    def kill_after(self, deadline: float) -> None:
        """Wait until ``deadline`` (time.monotonic) for the exit; then SIGKILL the group."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def stop_all(workers: Sequence[Worker], grace_seconds: float) -> None:
    """Stop every worker still running: end-of-file/SIGTERM now, SIGKILL after the grace."""
    running = [w for w in workers if w.poll() is None]
    for w in running:
        w.stop()
    deadline = time.monotonic() + grace_seconds + 2.0
    for w in running:
        w.kill_after(deadline)
