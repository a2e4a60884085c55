"""PyTorch Lightning on hora: :class:`HoraEnvironment`, the cluster environment of ``hora run``.

Lightning's ``DDPStrategy(process_group_backend="hora")`` puts a Trainer's collectives on hora
(docs/ddp.md). Under ``hora run`` the ranks are started by hora's launcher, which Lightning does
not know: pass ``plugins=[HoraEnvironment()]`` to the Trainer and Lightning takes each rank's
identity (rank, size, local rank, node rank) from hora's variables instead of launching processes
of its own::

    from hora.torch.lightning import HoraEnvironment

    trainer = Trainer(accelerator="cpu", devices=2, plugins=[HoraEnvironment()],
                      strategy=DDPStrategy(process_group_backend="hora"))

Lightning chooses its environment from a fixed list (TorchElastic, SLURM, LSF, MPI; else its
own, which starts the processes itself unless ``LOCAL_RANK`` is set); it asks no plugin's
``detect()``, so the environment must be given. :meth:`HoraEnvironment.detect` says whether
the process runs under ``hora run``, for scripts that choose for themselves
(``[HoraEnvironment()] if HoraEnvironment.detect() else []``). Lightning Fabric takes plugins
the same way (``Fabric(plugins=[...])``; not tested).

Importing this module needs ``pytorch_lightning`` (the ``lightning`` extra) and registers
``backend="hora"`` with torch, as ``import hora.torch.distributed`` does, so that one import
serves both launchers. Runs in the thread that makes the Trainer.
"""

from __future__ import annotations

import os

from lightning_fabric.plugins.environments import ClusterEnvironment

import hora.torch.distributed  # noqa: F401 - registers backend="hora", fills torch's env
from hora.identity import Identity
from hora.identity import detect as detect_identity

__all__ = ["HoraEnvironment"]


class HoraEnvironment(ClusterEnvironment):
    """Lightning's view of a ``hora run`` job: rank, size, local rank and node rank are hora's
    (``HORA_RANK``, ``HORA_SIZE``, ``HORA_LOCAL_RANK``, ``HORA_CROSS_RANK``, or their
    ``HOROVOD_`` names); torch's store listens at ``MASTER_ADDR:MASTER_PORT``, which hora fills
    in on one host (a job across hosts exports ``MASTER_ADDR``, the host of rank 0). The
    launcher starts the processes, so Lightning starts none. Made outside ``hora run`` it
    raises, saying so."""

    def __init__(self) -> None:
        super().__init__()
        if not self.detect():
            raise RuntimeError(
                "HoraEnvironment: HORA_RANK and HORA_SIZE are not set, so this process was not "
                "started by `hora run`: start it with `hora run -np N python train.py`, or "
                "leave HoraEnvironment out and let Lightning launch the processes"
            )
        self._id: Identity = detect_identity()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            raise RuntimeError(
                "HoraEnvironment: the ranks span hosts and MASTER_ADDR is not set; export the "
                "host of rank 0 to every rank: MASTER_ADDR=<host> hora run -np N -H ..."
            )
        return addr

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])  # hora's, from the job's secret

    @staticmethod
    def detect() -> bool:
        """Whether this process was started by ``hora run`` (hora's rank and size are set)."""
        env = os.environ
        return any(env.get(f"{p}_RANK") and env.get(f"{p}_SIZE") for p in ("HORA", "HOROVOD"))

    def world_size(self) -> int:
        return self._id.size

    def set_world_size(self, size: int) -> None:
        pass  # the launcher's; validate_settings() checks that the Trainer agrees

    def global_rank(self) -> int:
        return self._id.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # the launcher's

    def local_rank(self) -> int:
        return self._id.local_rank

    def node_rank(self) -> int:
        return self._id.cross_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self._id.size:
            raise ValueError(
                f"HoraEnvironment: the Trainer asks for devices={num_devices} x "
                f"num_nodes={num_nodes} = {num_devices * num_nodes} processes, but `hora run` "
                f"started {self._id.size}; make them agree (devices=<ranks per host>, "
                "num_nodes=<hosts>)"
            )
