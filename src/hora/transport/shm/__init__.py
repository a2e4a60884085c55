"""Shared-memory transport between ranks of one host (see transport/base.py for the contract).

``ShmTransport`` owns one abstract Unix listener and the shared-memory Pairs of one rank;
``ShmPair`` is one connection. Payloads larger than a socket write are copied once, straight
out of the sender's memory (``cma``: ``process_vm_readv``), or, where the kernel refuses that,
through an anonymous shared staging area (``staging``). Layout: ``cma`` (single-copy reads),
``staging`` (memfd slots), ``waiting`` (polling, yielding, where cores are shared), ``pair``
(frames, acknowledgements, reducing receives), ``transport`` (listening, connecting, probing).
"""

from hora.transport.shm.pair import ShmPair
from hora.transport.shm.transport import ShmTransport, available

__all__ = ["ShmPair", "ShmTransport", "available"]
