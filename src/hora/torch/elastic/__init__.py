"""``hvd.elastic`` for PyTorch: Horovod's ``horovod.torch.elastic`` on hora.

``run``, ``State``, ``ObjectState``, ``TorchState`` and ``ElasticSampler``; the state handlers
live in :mod:`hora.torch.elastic.state` (as in Horovod's ``horovod/torch/elastic/state.py``), the
sampler in :mod:`hora.torch.elastic.sampler`.
"""

from hora.torch.elastic.state import (
    ElasticSampler,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    StateHandler,
    TorchState,
    get_handler_registry,
    run,
    set_handler_registry,
)

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "run",
    "set_handler_registry",
]
