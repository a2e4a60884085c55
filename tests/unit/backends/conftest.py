"""The backend tests' fixtures: a real rendezvous store with one client per rank, and a fake of
torch.cuda's streams (the GPU, which these machines lack)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cuda_fakes import FakeStreams
from hora.rendezvous.client import StoreClient
from hora.rendezvous.server import RendezvousServer


@contextmanager
def store_clients(count: int) -> Iterator[list[StoreClient]]:
    """A store on loopback and ``count`` clients of it (one per rank)."""
    secret = secrets.token_bytes(16)
    server = RendezvousServer(secret, host="127.0.0.1")
    port = server.start()
    clients = [StoreClient("127.0.0.1", port, secret, timeout=10) for _ in range(count)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()
        server.stop()


@pytest.fixture
def store() -> Iterator[list[StoreClient]]:
    """A store and two clients of it (ranks 0 and 1)."""
    with store_clients(2) as clients:
        yield clients


@pytest.fixture
def store4() -> Iterator[list[StoreClient]]:
    """A store and four clients of it (ranks 0 to 3)."""
    with store_clients(4) as clients:
        yield clients



@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStreams:
    """torch.cuda's streams and events replaced by a fake that logs their order (no GPU)."""
    fake = FakeStreams()
    fake.install(monkeypatch.setattr)
    return fake
