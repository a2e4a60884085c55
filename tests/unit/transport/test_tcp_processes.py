"""TcpTransport between real processes (multiprocessing 'spawn'), including a SIGKILLed peer."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from hora.errors import TransportError
from hora.rendezvous import RendezvousServer, StoreClient
from hora.transport.base import CONTROL, DATA
from hora.transport.tcp import TcpTransport

SECRET = b"process-test-secret"
pytestmark = pytest.mark.timeout(90)


def worker(rank: int, port: int, prefix: str, mode: str) -> None:
    """Rank 1 in a child process: 'echo' doubles one array back; 'hang' waits to be killed."""
    store = StoreClient("127.0.0.1", port, SECRET, timeout=30.0)
    transport = TcpTransport(rank, 2, SECRET, store, prefix)
    data, ctrl = transport.pair(0, DATA), transport.pair(0, CONTROL)
    if mode == "echo":
        n = int(ctrl.recv_msg())
        buf = np.empty(n, dtype=np.float32)
        data.recv_into(buf)
        data.isend(buf * 2).wait(30)
        ctrl.send_msg(b"bye")
        ctrl.recv_msg()  # the parent's "done": close only after it has everything
    else:
        store.set(f"{prefix}/ready", b"1")
        threading.Event().wait(60)
    transport.close()
    store.close()


@pytest.fixture
def store() -> Iterator[tuple[StoreClient, int]]:
    with (
        RendezvousServer(SECRET, "127.0.0.1") as server,
        StoreClient("127.0.0.1", server.port, SECRET, timeout=30.0) as client,
    ):
        yield client, server.port


def start(port: int, prefix: str, mode: str) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(target=worker, args=(1, port, prefix, mode))
    proc.start()
    return proc


def test_two_processes_exchange_data_and_messages(store: tuple[StoreClient, int]) -> None:
    client, port = store
    proc = start(port, "echo", "echo")
    try:
        with TcpTransport(0, 2, SECRET, client, "echo") as transport:
            data, ctrl = transport.pair(1, DATA), transport.pair(1, CONTROL)
            payload = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)
            ctrl.send_msg(str(payload.size).encode())
            data.send(payload)
            back = np.empty_like(payload)
            data.irecv(back).wait(30)
            assert ctrl.recv_msg() == b"bye"
            ctrl.send_msg(b"done")
            np.testing.assert_array_equal(back, payload * 2)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        proc.kill()


def test_sigkilled_peer_fails_a_blocked_recv(store: tuple[StoreClient, int]) -> None:
    client, port = store
    proc = start(port, "kill", "hang")
    try:
        with TcpTransport(0, 2, SECRET, client, "kill") as transport:
            data = transport.pair(1, DATA)
            transport.pair(1, CONTROL)
            client.get("kill/ready", timeout=30)
            errors: list[BaseException] = []

            def receive() -> None:
                try:
                    data.recv_into(bytearray(1 << 20))
                except TransportError as e:
                    errors.append(e)

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
            thread.join(0.3)
            assert thread.is_alive()
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            thread.join(5)  # EOF arrives at once; keepalive would take ~8 s
            assert not thread.is_alive()
            assert len(errors) == 1
            assert "rank 1 (data channel) closed (peer exited or was killed)" in str(errors[0])
    finally:
        proc.kill()
        proc.join(10)
