"""hora's ``torch.distributed`` backend, the light part: ``backend="hora"`` by name.

torch calls :func:`plugin` at ``import torch`` when hora is installed as a package (the
``torch.backends`` entry point in pyproject.toml); ``import hora.torch.distributed`` calls
:func:`register` too. Both only register the name with torch and, under ``hora run``, fill in
torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) that the launcher does not set. This module lies outside the
``hora`` package so that torch's start-up imports nothing of hora; hora's engine is imported
when a process group is made (:mod:`hora.torch.distributed.group`). Runs in the importing
thread. hora serves CPU and CUDA tensors; ``"cpu:hora,cuda:nccl"`` and ``"cuda:hora"`` give it
one of them (:mod:`hora.torch.distributed.devices`).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

BACKEND = "hora"
# the ports a job derives (hora.identity.DERIVED_PORTS, which this module cannot import without
# loading hora at torch's start-up): below Linux's ephemeral ports (32768-60999 by default),
# where one may already be held by another process's socket bound to port 0
DERIVED_PORTS = range(20000, 32768)

__all__ = ["BACKEND", "plugin", "register", "torch_env_from_hora_run"]


def _hora_var(name: str) -> str | None:
    for prefix in ("HORA_", "HOROVOD_"):
        value = os.environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return None


def torch_env_from_hora_run() -> dict[str, str]:
    """Under ``hora run``: set torch's ``env://`` variables the launcher leaves unset, and
    return those set. Every rank derives the same ``MASTER_PORT`` from the job's secret; a
    job whose ranks span hosts needs ``MASTER_ADDR`` (the host of rank 0) exported to every
    rank, as torch asks of any launcher. Outside ``hora run``: nothing."""
    rank, size = _hora_var("RANK"), _hora_var("SIZE")
    if rank is None or size is None:
        return {}
    want = {
        "RANK": rank,
        "WORLD_SIZE": size,
        "LOCAL_RANK": _hora_var("LOCAL_RANK") or "0",
        "LOCAL_WORLD_SIZE": _hora_var("LOCAL_SIZE") or "1",
    }
    if (_hora_var("LOCAL_SIZE") or "1") == size:  # one host: rank 0 is here
        want["MASTER_ADDR"] = "127.0.0.1"
    secret = _hora_var("SECRET_KEY") or ""
    digest = hashlib.sha256(b"hora-torch-store\0" + secret.encode()).digest()
    index = int.from_bytes(digest[:4], "big") % len(DERIVED_PORTS)
    if str(DERIVED_PORTS[index]) == _hora_var("RENDEZVOUS_PORT"):
        index = (index + 1) % len(DERIVED_PORTS)
    port = DERIVED_PORTS[index]
    want["MASTER_PORT"] = str(port)
    filled = {k: v for k, v in want.items() if k not in os.environ}
    os.environ.update(filled)
    return filled


def _create(options: Any, backend_options: Any = None) -> Any:
    """torch's creator for ``backend="hora"``: imports the engine side only now."""
    from hora.torch.distributed.devices import create

    return create(options, backend_options)


def register() -> None:
    """Register ``"hora"`` with ``torch.distributed`` (idempotent) and fill torch's env under
    ``hora run``."""
    import torch.distributed as dist

    torch_env_from_hora_run()
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def plugin() -> None:
    """The ``torch.backends`` entry point torch calls at ``import torch``. It never raises:
    torch would fail its own import; ``import hora.torch.distributed`` then says what is
    wrong."""
    try:
        register()
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"hora's torch.distributed backend was not registered: {e}", stacklevel=2)

