"""Where an elastic job's workers and its launcher meet: keys in the rendezvous store.

The job goes through *rounds*. In each, the launcher (:mod:`hora.elastic.driver`) gives every
member worker its rank and topology; the workers build their connections under the round's own
prefix, so a round never mixes with the one before. Keys, all under ``elastic/``:

* ``round``: the newest round formed (decimal).
* ``<r>/assign/<worker>``: ``rank,size,local_rank,local_size,cross_rank,cross_size,host`` of a
  member of round ``r``; ``<r>/formed`` is set once all of round ``r`` is written, to the
  count of host changes (``hosts`` below) the round takes in.
* ``<r>/ready/<worker>``: a worker asks to be in round ``r`` (after a failure, a change of
  hosts, or when it is new).
* ``removed/<worker>``: the worker's host left the job (removed by discovery, or blacklisted
  after a failure there); at its next re-formation it leaves cleanly (:class:`WorkerRemoved`).
* ``hosts``: ``count,removed_only``: how often the hosts changed, and whether the last change
  only removed workers (then nobody needs the state sent again).

A worker is named by ``HORA_ELASTIC_ID`` (``host:index``), which the launcher sets when it starts
it. Worker side: :func:`join`, from ``hora.init()`` in the training thread. This module sits in
the rendezvous layer: the core (worker side) and the elastic driver (launcher side) both use it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from hora.errors import HoraInternalError, RendezvousError
from hora.identity import Identity
from hora.settings import env_lookup
from hora.transport.endpoint import gone_key as transport_gone_key

log = logging.getLogger("hora.elastic")

_SLACK = 10.0  # seconds a worker waits for a round beyond the launcher's --elastic-timeout
ROUND = "elastic/round"
HOSTS = "elastic/hosts"


class WorkerRemoved(HoraInternalError):
    """This worker's host left the elastic job; the worker should exit (with 0)."""


def assign_key(r: int, worker: str) -> str:
    return f"elastic/{r}/assign/{worker}"


def ready_key(r: int, worker: str) -> str:
    return f"elastic/{r}/ready/{worker}"


def formed_key(r: int) -> str:
    return f"elastic/{r}/formed"


def gone_key(r: int) -> str:
    """Where the launcher writes that a worker of round ``r`` died, so that the others stop
    waiting for its connections at once (round ``r``'s connections live under ``hora/e<r>``,
    the runtime's prefix for an elastic round)."""
    return transport_gone_key(f"hora/e{r}")


def removed_key(worker: str) -> str:
    return f"elastic/removed/{worker}"


def encode_assignment(slot: Any) -> bytes:
    """A :class:`~hora.launch.hosts.SlotInfo` as the value of an ``assign`` key."""
    fields = (
        slot.rank,
        slot.size,
        slot.local_rank,
        slot.local_size,
        slot.cross_rank,
        slot.cross_size,
        slot.hostname,
    )
    return ",".join(str(f) for f in fields).encode()


def round_host_updates(store: Any, r: int) -> int:
    """How many host changes the launcher had made when it formed round ``r``: those the
    round takes in (a later change interrupts its workers)."""
    return int(store.get(formed_key(r)))


def read_host_updates(store: Any) -> tuple[int, bool]:
    if not store.check([HOSTS]):
        return 0, False
    count, removed_only = store.get(HOSTS).decode().split(",")
    return int(count), removed_only == "1"


def is_elastic_worker(env: Mapping[str, str]) -> bool:
    return bool(env_lookup(env, "ELASTIC_ID"))


def join(env: Mapping[str, str], last_round: int, timeout: float) -> tuple[Identity, int]:
    """This worker's identity in the newest round it belongs to that is after ``last_round``
    (-1: none yet), asking the launcher for a place in the next round when it has none.

    Waits up to ``timeout`` seconds (``HOROVOD_ELASTIC_TIMEOUT``) for the launcher to form it,
    and a little longer so that the launcher, which gives up first, says why;
    raises :class:`WorkerRemoved` when the launcher took this worker's host out of the job.
    """
    from hora.rendezvous.client import StoreClient

    worker = str(env_lookup(env, "ELASTIC_ID"))
    addr = env_lookup(env, "RENDEZVOUS_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = env_lookup(env, "RENDEZVOUS_PORT") or env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    secret = env_lookup(env, "SECRET_KEY")
    if not (addr and port and secret):
        raise ValueError(
            f"elastic worker {worker}: the launcher's store address or secret is "
            "missing; start elastic jobs with `hora run --min-np/--max-np ...`"
        )
    # a little longer than the launcher, which gives up first and says why
    deadline = time.monotonic() + timeout + _SLACK
    removed = WorkerRemoved(f"worker {worker} has been removed from elastic job")
    with StoreClient(addr, int(port), bytes.fromhex(secret), timeout=timeout) as store:
        target = last_round + 1
        if store.check([removed_key(worker)]):
            raise removed
        if target > 0:
            store.set(ready_key(target, worker), b"1")
        while True:
            left = deadline - time.monotonic()
            try:
                # short waits: a worker removed while it waits must learn of it
                store.wait([formed_key(target)], timeout=max(min(left, 1.0), 0.1))
            except RendezvousError:
                if store.check([removed_key(worker)]):
                    raise removed from None
                if time.monotonic() < deadline:
                    continue
                raise HoraInternalError(
                    f"elastic worker {worker}: the launcher formed no new round within "
                    f"{timeout:g}s (HOROVOD_ELASTIC_TIMEOUT)"
                ) from None
            newest = int(store.get(ROUND))
            key = assign_key(newest, worker)
            if store.check([key]):
                fields = store.get(key).decode().split(",")
                break
            if store.check([removed_key(worker)]):
                raise removed
            target = newest + 1  # formed without this worker: ask for the next one
            store.set(ready_key(target, worker), b"1")
    rank, size, local_rank, local_size, cross_rank, cross_size = (int(f) for f in fields[:6])
    _export(rank, size, local_rank, local_size, cross_rank, cross_size)
    log.info("elastic worker %s: round %d, rank %d of %d", worker, newest, rank, size)
    ident = Identity(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=fields[6],
        rendezvous_addr=addr,
        rendezvous_port=int(port),
        secret=bytes.fromhex(secret),
        source="hora",
    )
    return ident, newest


def _export(*values: int) -> None:
    """Rewrite the identity variables, as Horovod does after every reset."""
    names = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
    for key, value in zip(names, values):
        os.environ["HORA_" + key] = os.environ["HOROVOD_" + key] = str(value)
