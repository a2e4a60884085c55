"""Starting hora for ``init_process_group(backend="hora")`` when the script has not.

- Under ``hora run`` (``HORA_RANK``... set): ``hvd.init()`` with the launcher's rendezvous, as
  any hora job starts.
- Under torchrun, or any other ``init_method`` (``env://``, ``tcp://``...): torch's own store,
  the one ``init_process_group`` just built, carries what hora's start needs. Rank 0 picks a free
  port for hora's rendezvous store and a fresh secret and puts them there; every rank reads them
  and starts hora as a torchrun-started hora job does, rank 0 hosting the store at
  ``MASTER_ADDR`` (or the torch store's host).

Either way hora starts with dynamic process sets, so ``dist.new_group`` works, and its rank and
size must be torch's. A script that called ``hvd.init()`` itself keeps its hora. Runs in the
thread that calls ``init_process_group``.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import hora.torch as hvd

_KEY = "hora/bootstrap"


def _under_hora_run() -> bool:
    return any(os.environ.get(f"{p}_RANK") for p in ("HORA", "HOROVOD"))


def _store_host(store: Any) -> str | None:
    """The host of the TCPStore under torch's prefix stores, if any."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])


def _exchange(options: Any) -> None:
    """Agree on hora's rendezvous through torch's store and export it for ``hvd.init()``."""
    store, rank, size = options.store, int(options.group_rank), int(options.group_size)
    addr = (os.environ.get("HORA_RENDEZVOUS_ADDR") or os.environ.get("MASTER_ADDR")
            or _store_host(store) or "127.0.0.1")  # fmt: skip
    if rank == 0:
        value = f"{addr} {_free_port(addr)} {secrets.token_hex(32)}"
        store.set(_KEY, value)
    else:
        value = store.get(_KEY).decode()
    addr, port, secret = value.split()
    os.environ.update(
        HORA_RENDEZVOUS_ADDR=addr, HORA_RENDEZVOUS_PORT=port, HORA_SECRET_KEY=secret
    )
    # hora reads torchrun's variables; a tcp:// or explicit-rank start may lack them
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(size))


def ensure_hora(options: Any) -> None:
    """Start hora for the default group made from torch's ``options`` (rank, size, store),
    unless it runs; check that hora's world is torch's."""
    rank, size = int(options.group_rank), int(options.group_size)
    if not hvd.is_initialized():
        if not _under_hora_run() and size > 1:
            _exchange(options)
        hvd.init(process_sets="dynamic")
    if (hvd.rank(), hvd.size()) != (rank, size):
        raise ValueError(
            f"hora backend: torch sees rank {rank} of {size} but hora runs rank "
            f"{hvd.rank()} of {hvd.size()}: start the job with `hora run -np N` (torch's "
            "variables are then filled in) or with torchrun alone, not both"
        )
