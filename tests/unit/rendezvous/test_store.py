"""Rendezvous store: real server, real clients, real sockets, threads for the blocking calls."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from hora.errors import RendezvousError
from hora.rendezvous import RendezvousServer, StoreClient
from hora.rendezvous.protocol import (
    ERROR,
    STORE_CONTEXT,
    decode_reply,
    recv_frame,
    send_frame,
)
from hora.transport.tcp.auth import connect_handshake

SECRET = b"store-test-secret"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    with RendezvousServer(SECRET, "127.0.0.1") as srv:
        yield srv


@pytest.fixture
def client(server: RendezvousServer) -> Iterator[StoreClient]:
    with StoreClient("127.0.0.1", server.port, SECRET, timeout=10.0) as c:
        yield c


def run_thread(target, *args) -> tuple[threading.Thread, dict]:
    """Run ``target`` on a thread; the dict gets 'value' or 'error'."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = target(*args)
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def test_set_get_binary_and_empty(client: StoreClient) -> None:
    client.set("bin", bytes(range(256)))
    client.set("empty", b"")
    assert client.get("bin") == bytes(range(256))
    assert client.get("empty") == b""
    client.set("bin", b"new")
    assert client.get("bin") == b"new"


def test_get_waits_for_a_later_set(server: RendezvousServer, client: StoreClient) -> None:
    thread, out = run_thread(client.get, "late", 20.0)
    with StoreClient("127.0.0.1", server.port, SECRET) as other:
        assert not other.check(["late"])
        other.set("late", b"here")
    thread.join(20)
    assert out == {"value": b"here"}


def test_get_timeout_names_key_and_address(server: RendezvousServer, client: StoreClient) -> None:
    with pytest.raises(RendezvousError, match=rf"'missing'.*127\.0\.0\.1:{server.port}"):
        client.get("missing", timeout=0.2)
    client.set("after", b"ok")  # the connection is still usable
    assert client.get("after") == b"ok"


def test_add_is_atomic_across_threads(client: StoreClient) -> None:
    assert client.add("n", 5) == 5
    assert client.add("n", -2) == 3
    threads = [run_thread(lambda: [client.add("count", 1) for _ in range(50)]) for _ in range(8)]
    for thread, out in threads:
        thread.join(30)
        assert "error" not in out
    assert client.add("count", 0) == 400
    assert client.get("count") == b"400"


def test_add_on_non_integer_is_an_error(client: StoreClient) -> None:
    client.set("text", b"abc")
    with pytest.raises(RendezvousError, match="does not hold an integer"):
        client.add("text", 1)


def test_check_delete_wait(client: StoreClient) -> None:
    client.set("a", b"1")
    assert client.check(["a"])
    assert not client.check(["a", "b"])
    thread, out = run_thread(client.wait, ["a", "b"], 20.0)
    client.set("b", b"2")
    thread.join(20)
    assert out == {"value": None}
    assert client.delete("a") is True
    assert client.delete("a") is False
    with pytest.raises(RendezvousError, match=r"\['a'\]"):
        client.wait(["a", "b"], timeout=0.2)


def test_bad_arguments_raise_clear_errors(client: StoreClient) -> None:
    with pytest.raises(TypeError, match="bytes"):
        client.set("k", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        client.get(b"k")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of keys"):
        client.check("k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        client.get("k", timeout=-1)


def test_wrong_secret_is_rejected_and_server_keeps_serving(
    server: RendezvousServer, client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hora.rendezvous.server")
    with pytest.raises(RendezvousError, match="did not accept"):
        StoreClient("127.0.0.1", server.port, b"wrong", timeout=5.0)
    assert any("rejected a connection" in r.getMessage() for r in caplog.records)
    client.set("still", b"works")
    assert client.get("still") == b"works"


def test_garbage_bytes_are_dropped(
    server: RendezvousServer, client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hora.rendezvous.server")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(b"\xff" * 4096)
        raw.settimeout(10)
        with contextlib.suppress(ConnectionResetError):  # unread bytes: RST instead of FIN
            while raw.recv(4096):  # until the server closes the connection
                pass
    assert any("rejected a connection" in r.getMessage() for r in caplog.records)
    client.set("k", b"v")
    assert client.get("k") == b"v"


def test_malformed_request_gets_error_reply(server: RendezvousServer, client: StoreClient) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        connect_handshake(raw, SECRET, STORE_CONTEXT)
        raw.settimeout(10)
        send_frame(raw, b"\x63junk")
        status, _, message = decode_reply(recv_frame(raw))
        assert status == ERROR and b"malformed" in message
        raw.sendall(b"\xff\xff\xff\xff")  # absurd frame length: dropped
        assert raw.recv(1) == b""
    assert client.add("ok", 1) == 1


def test_client_retries_until_server_starts() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    thread, out = run_thread(lambda: StoreClient("127.0.0.1", port, SECRET, timeout=20.0))
    thread.join(0.3)
    with RendezvousServer(SECRET, "127.0.0.1", port):
        thread.join(20)
        assert "value" in out, out
        out["value"].set("k", b"v")
        assert out["value"].get("k") == b"v"
        out["value"].close()


def test_unreachable_store_names_address() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port}.*launcher is running"):
        StoreClient("127.0.0.1", port, SECRET, timeout=0.3)


def test_close_interrupts_a_blocked_get(client: StoreClient) -> None:
    thread, out = run_thread(client.get, "never", 30.0)
    thread.join(0.2)
    client.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), RendezvousError)
    with pytest.raises(RendezvousError, match="closed"):
        client.set("k", b"v")


def test_stop_releases_blocked_clients(server: RendezvousServer, client: StoreClient) -> None:
    thread, out = run_thread(client.get, "never", 30.0)
    thread.join(0.2)
    server.stop()
    server.stop()  # idempotent
    thread.join(5)
    assert isinstance(out.get("error"), RendezvousError)
