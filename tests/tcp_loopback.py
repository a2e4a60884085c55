"""Two TcpPairs over one real TCP connection on loopback, configured as the TCP transport
configures its sockets, under the transport's watch for vanished hosts
(:mod:`hora.transport.tcp.liveness`) with the given thresholds. The caller stops the watch and
closes the pairs."""

from __future__ import annotations

import socket

from hora.transport.base import DATA
from hora.transport.tcp import TcpPair
from hora.transport.tcp.liveness import AckWatch
from hora.transport.tcp.wire import configure


def watched_pairs(silence_s: float, check_s: float) -> tuple[TcpPair, TcpPair, AckWatch]:
    """(the connecting end, the accepting end, the running watch)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    configure(a)
    configure(b)
    left, right = TcpPair(a, 1, DATA), TcpPair(b, 0, DATA)
    watch = AckWatch(lambda: [left, right], "test-watch", silence_s=silence_s, check_s=check_s)
    watch.start()
    return left, right, watch
