"""TcpTransport in one process: ranks on threads, a real rendezvous store, real TCP sockets."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from hora.errors import AuthenticationError, TransportError
from hora.rendezvous import RendezvousServer, StoreClient
from hora.transport.base import CONTROL, DATA, Transport
from hora.transport.tcp import TcpPair, TcpTransport
from hora.transport.tcp.transport import advertise_address, interface_address

SECRET = b"transport-test-secret"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store() -> Iterator[StoreClient]:
    with (
        RendezvousServer(SECRET, "127.0.0.1") as server,
        StoreClient("127.0.0.1", server.port, SECRET, timeout=10.0) as client,
    ):
        yield client


def on_ranks(size: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank; re-raise the first error."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # handed to the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "rank thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def world(store: StoreClient) -> Iterator[list[TcpTransport]]:
    transports = [
        TcpTransport(r, 3, SECRET, store, "job/0", connect_timeout=10.0) for r in range(3)
    ]
    yield transports
    for t in transports:
        t.close()


def connect_all(world: list[TcpTransport], channel: int = DATA) -> list[dict[int, TcpPair]]:
    size = len(world)
    return on_ranks(size, lambda r: {p: world[r].pair(p, channel) for p in range(size) if p != r})


def test_publishes_loopback_address(store: StoreClient, world: list[TcpTransport]) -> None:
    assert isinstance(world[0], Transport)
    host, port = world[1].listen_address
    assert host == "127.0.0.1"
    assert store.get("job/0/addr/1") == f"{host}:{port}".encode()


def test_all_pairs_both_channels(world: list[TcpTransport]) -> None:
    for channel in (DATA, CONTROL):
        pairs = connect_all(world, channel)

        def exchange(rank: int, pairs: list[dict[int, TcpPair]] = pairs) -> list[Any]:
            out = []
            for peer, pair in sorted(pairs[rank].items()):
                work = pair.isend(np.full(1000, rank * 10 + peer, dtype=np.int64))
                pair.send_msg(f"{rank}->{peer}".encode())
                got = np.zeros(1000, dtype=np.int64)
                pair.recv_into(got)
                out.append((peer, int(got[0]), pair.recv_msg().decode()))
                work.wait(10)
            return out

        results = on_ranks(3, exchange)
        for rank, got in enumerate(results):
            assert got == [(p, p * 10 + rank, f"{p}->{rank}") for p in range(3) if p != rank]
    assert world[0].pair(1, DATA) is not world[0].pair(1, CONTROL)
    assert world[0].pair(1, DATA).fileno() != world[0].pair(1, CONTROL).fileno()


def test_pair_is_idempotent(world: list[TcpTransport]) -> None:
    first = connect_all(world)
    again = connect_all(world)
    assert all(first[r][p] is again[r][p] for r in range(3) for p in first[r])


def test_bad_pair_arguments(world: list[TcpTransport]) -> None:
    with pytest.raises(ValueError, match="another rank"):
        world[0].pair(0)
    with pytest.raises(ValueError, match="another rank"):
        world[0].pair(3)
    with pytest.raises(ValueError, match="channel"):
        world[0].pair(1, 7)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        TcpTransport(3, 3, SECRET, world[0]._store, "x")  # type: ignore[arg-type]


def _capture_transport_warnings(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hora.init() in an earlier test of this process gives the "hora" logger its own handler
    # and stops propagation; caplog listens at the root, so let the records through again
    caplog.set_level(logging.WARNING, logger="hora.transport.tcp.transport")
    monkeypatch.setattr(logging.getLogger("hora"), "propagate", True)


def test_garbage_connection_is_dropped(
    world: list[TcpTransport], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _capture_transport_warnings(caplog, monkeypatch)
    with socket.create_connection(world[0].listen_address, timeout=10) as raw:
        local = raw.getsockname()
        raw.sendall(b"\x00\x10" + b"\xab" * 200)
        raw.settimeout(10)
        try:
            while raw.recv(4096):
                pass
        except ConnectionResetError:
            pass
    assert any(f"{local[0]}:{local[1]}" in r.getMessage() for r in caplog.records)
    pairs = connect_all(world)
    on_ranks(2, lambda r: pairs[r][1 - r].send_msg(b"x") or pairs[r][1 - r].recv_msg())


def test_wrong_secret_is_refused(
    store: StoreClient,
    world: list[TcpTransport],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capture_transport_warnings(caplog, monkeypatch)
    impostor = TcpTransport(1, 3, b"not-the-secret", store, "job/0", connect_timeout=5.0)
    try:
        with pytest.raises(AuthenticationError, match="rank 0 at .* refused rank 1"):
            impostor.pair(0)
    finally:
        impostor.close()
    assert any("wrong HMAC" in r.getMessage() for r in caplog.records)


def test_other_job_generation_is_refused(store: StoreClient, world: list[TcpTransport]) -> None:
    store.set("job/1/addr/0", store.get("job/0/addr/0"))  # point a new generation at rank 0
    stale = TcpTransport(2, 3, SECRET, store, "job/1", connect_timeout=5.0)
    try:
        with pytest.raises(AuthenticationError, match="closed the connection during the handshake"):
            stale.pair(0)
    finally:
        stale.close()


def test_waiting_for_a_silent_peer_times_out(store: StoreClient) -> None:
    with (
        TcpTransport(0, 2, SECRET, store, "lonely", connect_timeout=0.3) as lonely,
        pytest.raises(TransportError, match="rank 1 .*did not connect to rank 0"),
    ):
        lonely.pair(1)


def test_close_unblocks_recv_and_is_idempotent(world: list[TcpTransport]) -> None:
    pairs = connect_all(world)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            pairs[0][1].recv_into(bytearray(64))
        except TransportError as e:
            errors.append(e)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(0.2)
    closer = threading.Thread(target=world[0].close)
    closer.start()
    closer.join(5)
    world[0].close()
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1
    with pytest.raises(TransportError, match="closed"):
        world[0].pair(2)
    with pytest.raises(TransportError, match="rank 0 .* closed \\(peer exited"):
        pairs[1][0].recv_into(bytearray(64))


def test_close_wakes_a_rank_waiting_for_its_peer(store: StoreClient) -> None:
    transport = TcpTransport(0, 2, SECRET, store, "wake", connect_timeout=30.0)
    timer = threading.Timer(0.2, transport.close)
    timer.start()
    with pytest.raises(TransportError, match="closed"):
        transport.pair(1)
    timer.join()


def test_address_helpers() -> None:
    assert advertise_address("", "127.0.0.1") == "127.0.0.1"
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match="no-such-if0.*available"):
        interface_address("no-such-if0")
