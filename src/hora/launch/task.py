"""``python -m hora.launch.task``: one rank of :func:`hora.launch.api.run`.

Reads its identity from the environment (:func:`hora.identity.detect`), fetches the
cloudpickled ``(func, args, kwargs)`` from the rendezvous store, calls it, and stores the
cloudpickled outcome under ``runfunc_result/<rank>``: ``("ok", value)`` or
``("error", exception, traceback text)``. Exits 1 after an exception so that the launcher stops
the other ranks. Runs in the worker's main thread.
"""

from __future__ import annotations

import sys
import traceback

import cloudpickle

from hora.identity import detect
from hora.rendezvous.client import StoreClient

FUNC_KEY = "runfunc/func"
RESULT_KEY = "runfunc_result/{rank}"


def _outcome_bytes(outcome: tuple[object, ...]) -> bytes:
    try:
        return cloudpickle.dumps(outcome)
    except Exception as e:  # the value or exception cannot be pickled
        text = f"{outcome[1]!r} could not be sent back to the launcher: {e}"
        trace = str(outcome[2]) if len(outcome) > 2 else text
        return cloudpickle.dumps(("error", RuntimeError(text), trace))


def main() -> int:
    ident = detect()
    if ident.rendezvous_addr is None or ident.rendezvous_port is None or ident.secret is None:
        print("hora.launch.task: start me with hora.run(...)", file=sys.stderr)
        return 2
    with StoreClient(ident.rendezvous_addr, ident.rendezvous_port, ident.secret) as store:
        func, args, kwargs = cloudpickle.loads(store.get(FUNC_KEY))
        try:
            outcome: tuple[object, ...] = ("ok", func(*args, **kwargs))
        except BaseException as e:  # reported to the caller of hora.run, then exit non-zero
            outcome = ("error", e, traceback.format_exc())
        store.set(RESULT_KEY.format(rank=ident.rank), _outcome_bytes(outcome))
    if outcome[0] == "error":
        print(outcome[2], file=sys.stderr, end="")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
