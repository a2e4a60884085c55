"""The listener's limits on a real rendezvous store: one deadline per handshake, a cap on
handshakes in progress, and rejections logged the first few times, then counted.

Probes connect only to the store each test starts, on loopback, a bounded number of times."""

from __future__ import annotations

import logging
import select
import socket
import time

import pytest

from hora.ratelog import RateLimitedLog
from hora.rendezvous import RendezvousServer, StoreClient
from hora.transport.listener import Listener
from hora.transport.shm.transport import ShmTransport, socket_name
from hora.transport.shm.transport import available as shm_available

SECRET = b"listener-test-secret"
GREETING = b"HORA\x01"
pytestmark = pytest.mark.timeout(60)


def _greeted(sock: socket.socket, wait: float) -> bool:
    """Whether the store sent its handshake greeting on ``sock`` within ``wait`` seconds."""
    ready, _, _ = select.select([sock], [], [], wait)
    return bool(ready) and sock.recv(len(GREETING), socket.MSG_PEEK) == GREETING


def _closed_by_server(sock: socket.socket, budget: float) -> bool:
    """Trickle one zero byte every 0.2 s for at most ``budget`` seconds; True once the server
    closed the connection."""
    end = time.monotonic() + budget
    while time.monotonic() < end:
        try:
            sock.sendall(b"\0")
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready and not sock.recv(4096):
                return True
        except OSError:
            return True
    return False


def test_a_trickling_handshake_is_dropped_at_its_deadline() -> None:
    with RendezvousServer(SECRET, "127.0.0.1", handshake_timeout=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as probe:
            # each byte would restart a per-read timeout; the deadline does not restart
            assert _closed_by_server(probe, budget=20.0)
        listener = server.listener
        assert listener is not None
        for _ in range(100):  # its admission thread wakes to count it just after the close
            if listener.counts["expired"]:
                break
            time.sleep(0.05)
        assert listener.counts["expired"] == 1
        with StoreClient("127.0.0.1", server.port, SECRET, timeout=10.0) as client:
            client.set("still", b"serving")  # an honest client is not held to the old deadline
            time.sleep(1.0)
            assert client.get("still") == b"serving"


@pytest.mark.skipif(not shm_available(), reason="the shared-memory transport needs Linux")
def test_the_shared_memory_listener_has_the_same_deadline() -> None:
    with ShmTransport(0, 2, SECRET, "deadline", handshake_timeout=0.5) as shm:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(socket_name(SECRET, "deadline", 0))
            assert _closed_by_server(probe, budget=20.0)
        listener = shm.listener
        assert listener is not None
        for _ in range(100):  # its admission thread counts it just after the close
            if listener.counts["expired"]:
                break
            time.sleep(0.05)
        assert listener.counts["expired"] == 1 and listener.pending == 0


def test_handshakes_in_progress_are_capped() -> None:
    with RendezvousServer(SECRET, "127.0.0.1", handshake_timeout=3.0, max_pending=3) as server:
        probes = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(6)]
        try:
            time.sleep(1.0)  # well inside the first three's deadline
            ready, _, _ = select.select(probes, [], [], 0)
            assert len(ready) == 3, ready  # the rest wait in the kernel's backlog
            assert server.listener is not None and server.listener.pending == 3
            # the first three run out of time, then the waiting three get their turn
            assert all(_greeted(p, 15.0) for p in probes[3:])
        finally:
            for p in probes:
                p.close()


def test_listener_checks_its_limits() -> None:
    with socket.socket() as sock:
        with pytest.raises(ValueError, match="deadline"):
            Listener(sock, lambda c, a: None, lambda c, a, r: None, "x", logging.getLogger(),
                     deadline=0)  # fmt: skip
        with pytest.raises(ValueError, match="max_pending"):
            Listener(sock, lambda c, a: None, lambda c, a, r: None, "x", logging.getLogger(),
                     max_pending=0)  # fmt: skip


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_shows_the_first_few_then_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("test.ratelog"), "drops", first=3, every=10.0,
                         clock=clock)  # fmt: skip
    caplog.set_level(logging.WARNING, logger="test.ratelog")
    for i in range(60):
        log.warning("drop %d", i)
        clock.now += 0.1  # 60 warnings in 6 s
    assert [r.getMessage() for r in caplog.records] == ["drop 0", "drop 1", "drop 2"]
    clock.now += 5.0
    log.flush()  # the window has ended: one line with the count
    assert caplog.records[-1].getMessage().startswith("57 more drops in the last 11 s")
    assert "drop 59" in caplog.records[-1].getMessage()
    for i in range(20):  # the flood goes on: only the summary, once per window
        log.warning("drop again %d", i)
        clock.now += 1.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5 and messages[-1].startswith("10 more drops"), messages
    log.flush(final=True)
    assert caplog.records[-1].getMessage().startswith("10 more drops")
    clock.now += 30.0
    log.warning("after a quiet spell")  # a fresh window shows it in full
    assert caplog.records[-1].getMessage() == "after a quiet spell"
