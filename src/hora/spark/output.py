"""The ranks' output, carried from the Spark tasks to streams in the driver (``run``'s
``stdout=``/``stderr=``).

The driver runs an :class:`OutputServer` (a listener on a free port, one reader thread per
connection); each task opens one connection per forwarded stream (:func:`connect`), proves
it knows the job's secret on the first line, and then sends the rank's output, already cut
into prefixed lines by the launcher's :class:`hora.launch.process.LinePrefixer`. Whole lines
are written to the driver's stream under one lock.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
from typing import Any

from hora.launch.process import ConsoleSink

STREAMS = ("stdout", "stderr")


class OutputServer:
    """Receives the tasks' output and writes it to ``targets`` (``{"stdout": stream, ...}``).

    Threads: one accept thread and one reader per connection; ``close`` (any thread) stops
    them after the readers have drained what was sent.
    """

    def __init__(self, secret: bytes, targets: dict[str, Any], host: str = "0.0.0.0"):
        self._secret = secret.hex().encode()
        self._sinks = {name: ConsoleSink(stream) for name, stream in targets.items()}
        self._listener = socket.create_server((host, 0), backlog=64)
        self.port = int(self._listener.getsockname()[1])
        self._readers: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepting = threading.Thread(
            target=self._accept, name="hora-spark-output", daemon=True
        )
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            with self._lock:
                self._conns.append(conn)
                self._readers.append(reader)
            reader.start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            head = f.readline().split()
            if len(head) != 2 or not hmac.compare_digest(head[0], self._secret):
                return
            sink = self._sinks.get(head[1].decode(errors="replace"))
            if sink is None:
                return
            for line in f:
                sink.write(line)

    def close(self, drain: float = 5.0) -> None:
        """Stop accepting; wait up to ``drain`` seconds for the readers, then close them."""
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            readers, conns = list(self._readers), list(self._conns)
        for reader in readers:
            reader.join(timeout=drain)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()


class _SocketStream:
    """A binary stream over one connection, for :class:`ConsoleSink` in the task."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def write(self, data: bytes) -> int:
        with contextlib.suppress(OSError):  # the driver is gone: the output is lost
            self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def connect(addr: str, port: int, secret: bytes, stream: str, timeout: float) -> _SocketStream:
    """The task's end of one forwarded ``stream`` (``"stdout"`` or ``"stderr"``)."""
    sock = socket.create_connection((addr, port), timeout=timeout)
    sock.settimeout(None)
    sock.sendall(secret.hex().encode() + b" " + stream.encode() + b"\n")
    return _SocketStream(sock)
