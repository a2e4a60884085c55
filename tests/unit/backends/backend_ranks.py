"""Two ranks of a backend as two threads of the test process (the backend unit tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hora.backends.base import SetComm
from hora.backends.registry import BackendContext
from hora.identity import Identity
from hora.rendezvous.client import StoreClient
from hora.settings import load


def run_threads(count: int, rank: Callable[[int], Any], timeout: float = 25) -> list[Any]:
    """``rank(r)`` for ``r`` in ``range(count)``, each in a thread of its own (named ``r<r>``):
    their results, or the first error; a rank still running after ``timeout`` fails."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = rank(r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), name=f"r{r}", daemon=True)
               for r in range(count)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def run_two_ranks(
    store: list[StoreClient],
    make: Callable[[BackendContext], Any],
    work: Callable[[Any, SetComm], Any],
) -> list[Any]:
    """Ranks 0 and 1 as two threads, each with the backend ``make`` builds over ``store``
    (set 0 of both ranks registered): ``work(backend, comm)``'s results, or the first error."""

    def rank(r: int) -> Any:
        me = Identity(rank=r, size=2, local_rank=r, local_size=2)
        ctx = BackendContext(me, load({"HORA_GLOO_TIMEOUT_SECONDS": "10"}), store[r], None,
                             "test")  # fmt: skip
        backend = make(ctx)
        try:
            return work(backend, SetComm([0, 1], r, None, 0))  # type: ignore[arg-type]
        finally:
            backend.close()

    return run_threads(2, rank)
