"""Names for a torch process group's collectives, so hora's response cache serves them.

hora negotiates an op it has not seen under its name in full (every rank asks the coordinator);
an op whose name and spec it has cached runs off the cache, and in steady training off direct
mode, without rank 0. torch's calls carry no names, so the group gives each one a name that
repeats as the training loop repeats: every rank submits a group's collectives in the same
order (torch asks it), so every rank sees the same sequence of *keys* (call, reduce op, dtypes,
element counts) and can learn the period of that sequence alike.

The rules, which depend only on the keys *before* an op (so an op whose key differs between
ranks, a shape mismatch, gets the same name on every rank, and hora's mismatch check reports
it):

- while a period ``P`` is confirmed, op ``n`` takes the name op ``n - P`` took;
- otherwise op ``n`` takes a fresh name (``c10d.0`` ... ``c10d.1023``, round and round).

After each op the learner checks its key against the key ``P`` ops back. A mismatch ends the
period and picks a candidate: the shortest distance back to an earlier op of the same key over
which the latest keys already repeat (else the distance to the latest op of that key). The
candidate is confirmed once ``P + 2`` ops in a row have matched it since (all named fresh, so a
confirmed period's names are distinct and each belongs to one key): a run of equal keys inside
a longer step is not taken for the period. A loop of one call (a benchmark) is thus served from
the cache from its sixth call on, a training step's calls from its fourth step, whatever the job
ran before (a DDP model's start, another loop).

A name still in flight from an earlier op is waited for before it is used again (that op was
submitted by every rank before this one, so it completes). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, Protocol

PERIOD_MAX = 512  # the longest period learnt
_FRESH = 2 * PERIOD_MAX  # fresh names go round this many
_KEPT = 2 * PERIOD_MAX  # keys and names remembered (trimmed to this many)
_KEYS_MAX = 4096  # distinct keys remembered; past this the learner starts again


class Waitable(Protocol):
    def wait_quietly(self) -> None: ...


class CallNames:
    """One process group's names (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fresh = 0
        self._live: dict[str, Waitable] = {}
        self._clear()

    def _clear(self) -> None:
        self._ids: dict[Hashable, int] = {}
        self._keys: list[int] = []  # key ids of the latest ops, oldest first
        self._names: list[int] = []  # their names' numbers
        self._period = 0  # confirmed
        self._candidate = 0
        self._run = 0  # ops in a row that matched the candidate since it was picked

    def name(self, key: tuple[Any, ...], wait: bool = True) -> str:
        """The name of the next op, whose key is ``key``. ``wait``: first wait for an earlier
        op under this name that is still in flight (never in hora's engine thread)."""
        with self._lock:
            keys, names = self._keys, self._names
            n = len(keys)
            if self._period:
                idx = names[n - self._period]
            else:
                idx = self._fresh
                self._fresh = (idx + 1) % _FRESH
            kid = self._ids.get(key)
            if kid is None:
                if len(self._ids) >= _KEYS_MAX:
                    self._clear()
                    keys, names, n = self._keys, self._names, 0
                kid = self._ids[key] = len(self._ids)
            keys.append(kid)
            names.append(idx)
            self._learn(n, kid)
            if n >= 2 * _KEPT:
                del keys[:-_KEPT], names[:-_KEPT]
            name = f"c10d.{idx}"
            before = self._live.get(name) if wait else None
        if before is not None and threading.current_thread().name != "hora-engine":
            before.wait_quietly()
        return name

    def _learn(self, n: int, kid: int) -> None:
        """Update the period with op ``n``'s key ``kid`` (already appended)."""
        p = self._period or self._candidate
        if p and n >= p and self._keys[n - p] == kid:
            if not self._period:
                self._run += 1
                if self._run >= p + 2:
                    self._period = p
            return
        self._period, self._run = 0, 0
        self._candidate = self._pick(n, kid)

    def _pick(self, n: int, kid: int) -> int:
        keys = self._keys
        first = 0
        for d in range(1, min(n, PERIOD_MAX) + 1):
            if keys[n - d] != kid:
                continue
            first = first or d
            if n + 1 < 2 * d:
                break
            if all(keys[n - j] == keys[n - j - d] for j in range(1, d)):
                return d
        return first

    def reset(self) -> None:
        """Forget the period: after a failed op (a mismatch) the ranks' histories may differ,
        and every rank sees the failure."""
        with self._lock:
            self._clear()

    def track(self, names: list[str], work: Waitable) -> None:
        """``work`` is in flight under ``names``."""
        with self._lock:
            for n in names:
                self._live[n] = work

    def untrack(self, names: list[str]) -> None:
        """Nothing is in flight under ``names`` any more."""
        with self._lock:
            for n in names:
                self._live.pop(n, None)
