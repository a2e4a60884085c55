"""Elastic training: workers may fail, leave or join while the job goes on.

Worker side: :func:`run` (the decorator), :class:`State` and :class:`ObjectState`
(``hora.torch.elastic`` adds ``TorchState`` and ``ElasticSampler``). Launcher side:
:mod:`hora.elastic.driver`, which ``hora run`` uses when given ``--min-np``, ``--max-np`` or
``--host-discovery-script``. The two meet in the rendezvous store (:mod:`hora.rendezvous.rounds`).
"""

from hora.elastic.run import run
from hora.elastic.state import ObjectState, State
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
