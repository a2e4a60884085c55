"""The rendezvous store: an authenticated key-value server and its client.

The launcher (or the elastic driver) runs a :class:`RendezvousServer` with a fresh per-job
secret; every rank opens a :class:`StoreClient` to publish and find addresses, count arrivals
and wait for keys. Wire format in :mod:`hora.rendezvous.protocol`.
"""

from hora.rendezvous.client import StoreClient
from hora.rendezvous.server import RendezvousServer

__all__ = ["RendezvousServer", "StoreClient"]
