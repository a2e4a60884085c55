"""``torch.distributed`` on hora: ``init_process_group(backend="hora")``.

One extra line in a DDP (or FSDP, Accelerate) script, ``import hora.torch.distributed``, and
``dist.init_process_group(backend="hora")`` runs every collective of the job on hora's engine
and transports, so hora's timeline, stall reports, rank-naming errors and ``hora run`` apply
(docs/ddp.md). Where hora is installed as a package, torch registers the name by itself at
``import torch`` (the ``torch.backends`` entry point, :mod:`hora_torch_plugin`).

Importing this module registers the backend and, under ``hora run``, fills in torch's
``env://`` variables; the process group itself is :class:`hora.torch.distributed.group.
HoraProcessGroup`, made by torch when the script asks for it. Runs in the importing thread.
"""

from __future__ import annotations

from hora_torch_plugin import BACKEND, register, torch_env_from_hora_run

register()

__all__ = ["BACKEND", "register", "torch_env_from_hora_run"]
