"""The backend tests' fixtures: a real rendezvous store with one client per rank, and a fake of
torch.cuda's streams (the GPU, which these machines lack)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from cuda_fakes import FakeStreams
from hora.rendezvous.client import StoreClient
from hora.rendezvous.server import RendezvousServer


@pytest.fixture
def store() -> Iterator[list[StoreClient]]:
    """A store on loopback and two clients of it (ranks 0 and 1)."""
    secret = secrets.token_bytes(16)
    server = RendezvousServer(secret, host="127.0.0.1")
    port = server.start()
    clients = [StoreClient("127.0.0.1", port, secret, timeout=10) for _ in range(2)]
    yield clients
    for c in clients:
        c.close()
    server.stop()



@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStreams:
    """torch.cuda's streams and events replaced by a fake that logs their order (no GPU)."""
    fake = FakeStreams()
    fake.install(monkeypatch.setattr)
    return fake
