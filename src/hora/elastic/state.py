"""Elastic training state: what a job keeps across a lost or added worker.

A :class:`State` holds the training state that must survive a reset. ``commit()`` saves a copy
in memory (and checks whether hosts were added or removed); after a collective failed,
``restore()`` rolls back to that copy; after every reset ``sync()`` makes every rank hold rank
0's copy (new workers included). ``ObjectState`` does this for plain Python attributes; the
framework bindings add their own (``hora.torch.elastic.TorchState``).

Used from the training thread; not thread-safe.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hora.errors import HostsUpdatedInterrupt


class State:
    """The base of every elastic state (Horovod's ``State(bcast_object, get_rank)``).

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._seen_updates = -1  # the host-update count this state last acted on

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after every reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`hora.elastic.run` after every reset: :meth:`reset`, then the reset
        callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Override to refresh what depends on the job's size (called on every reset)."""

    def on_hosts_updated(self, timestamp: int, skip_sync: bool) -> None:
        """Called when the launcher reported a change of hosts (before the interrupt)."""

    def commit(self) -> None:
        """Save the state, then raise :class:`HostsUpdatedInterrupt` on every rank if hosts
        were added or removed since the last check."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank together if the set of hosts
        changed; rank 0 asks the launcher and tells the others."""
        # rank 0's last count goes with the new one, so that every rank decides as rank 0
        # does: a worker that joined since (it has seen no count yet) raises with the others
        # A state that has not checked yet has seen the changes its round was formed with: a
        # change made before its first check (discovery that is quicker than the first
        # commit) still interrupts, and is not taken as already seen.
        mine = None
        if self._rank() == 0:
            seen = self._seen_updates if self._seen_updates >= 0 else round_host_updates()
            mine = (seen, *host_updates())
        seen, count, removed_only = self._bcast_object(mine, 0, name="hora.elastic.hosts")
        self._seen_updates = count
        if 0 <= seen < count:
            self.on_hosts_updated(count, removed_only)
            raise HostsUpdatedInterrupt(removed_only)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes as elastic state: ``ObjectState(bcast_object, get_rank, epoch=0)``.

    Each keyword becomes an attribute; ``save`` snapshots them (deep copies), ``restore`` puts
    the snapshot back, ``sync`` broadcasts rank 0's values to every rank.
    """

    def __init__(
        self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved = copy.deepcopy(kwargs)
        self.__dict__.update(kwargs)

    def _values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._saved}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        self.__dict__.update(copy.deepcopy(self._saved))

    def sync(self) -> None:
        if self._saved:
            values = self._bcast_object(self._values(), 0, name="hora.elastic.objects")
            self.__dict__.update(values)
        self.save()  # a restore after this goes back to the synced values


def round_host_updates() -> int:
    """How many host changes this worker's current round took in when the launcher formed it;
    0 outside an elastic job."""
    from hora.core import runtime
    from hora.rendezvous import rounds

    rt, r = runtime.runtime(), runtime.elastic_round()
    if not rt.settings.elastic or rt.store is None or r < 0:
        return 0
    return rounds.round_host_updates(rt.store, r)


def host_updates() -> tuple[int, bool]:
    """How many times the launcher has changed the hosts, and whether the last change only
    removed hosts; ``(0, False)`` outside an elastic job."""
    from hora.core import runtime
    from hora.rendezvous.rounds import read_host_updates

    rt = runtime.runtime()
    if not rt.settings.elastic or rt.store is None:
        return 0, False
    return read_host_updates(rt.store)
