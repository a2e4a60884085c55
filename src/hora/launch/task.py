"""``python -m hora.launch.task``: one rank of :func:`hora.launch.api.run`.

Reads its identity from the environment (:func:`hora.identity.detect`), fetches the
cloudpickled ``(func, args, kwargs)`` from the rendezvous store, calls it, and stores the
cloudpickled outcome under ``runfunc_result/<rank>``: ``("ok", value)`` or
``("error", exception, traceback text)``, under the rank it has when the function returns
(an elastic job assigns ranks in ``hvd.init()``), and the job's size then under
``runfunc_size``. Exits 1 after an exception so that the launcher stops
the other ranks. Runs in the worker's main thread.
"""

from __future__ import annotations

import os
import sys
import traceback

import cloudpickle

from hora.identity import detect
from hora.rendezvous.client import StoreClient
from hora.settings import env_lookup

FUNC_KEY = "runfunc/func"
RESULT_KEY = "runfunc_result/{rank}"
SIZE_KEY = "runfunc_size"  # the job's size when the function returned (elastic jobs change it)


def outcome_bytes(outcome: tuple[object, ...]) -> bytes:
    try:
        return cloudpickle.dumps(outcome)
    except Exception as e:  # the value or exception cannot be pickled
        text = f"{outcome[1]!r} could not be sent back to the launcher: {e}"
        trace = str(outcome[2]) if len(outcome) > 2 else text
        return cloudpickle.dumps(("error", RuntimeError(text), trace))


def _store_address() -> tuple[str | None, int | None, bytes | None]:
    """The launcher's store: from the identity, or (an elastic worker, whose rank comes only
    with ``hvd.init()``) from the rendezvous variables themselves."""
    ident = detect()
    if ident.rendezvous_addr is not None:
        return ident.rendezvous_addr, ident.rendezvous_port, ident.secret
    env = os.environ
    addr = env_lookup(env, "RENDEZVOUS_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = env_lookup(env, "RENDEZVOUS_PORT") or env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    secret = env_lookup(env, "SECRET_KEY")
    return addr, int(port) if port else None, bytes.fromhex(secret) if secret else None


def main() -> int:
    ident = detect()
    addr, port, secret = _store_address()
    if addr is None or port is None or secret is None:
        print("hora.launch.task: start me with hora.run(...)", file=sys.stderr)
        return 2
    with StoreClient(addr, port, secret) as store:
        func, args, kwargs = cloudpickle.loads(store.get(FUNC_KEY))
        try:
            outcome: tuple[object, ...] = ("ok", func(*args, **kwargs))
        except BaseException as e:  # reported to the caller of hora.run, then exit non-zero
            outcome = ("error", e, traceback.format_exc())
        # the rank now: an elastic job assigns it in hvd.init(), which updates the environment
        rank = int(env_lookup(os.environ, "RANK", str(ident.rank)) or ident.rank)
        size = env_lookup(os.environ, "SIZE", str(ident.size)) or str(ident.size)
        store.set(RESULT_KEY.format(rank=rank), outcome_bytes(outcome))
        if outcome[0] == "ok":
            store.set(SIZE_KEY, size.encode())
    if outcome[0] == "error":
        print(outcome[2], file=sys.stderr, end="")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
