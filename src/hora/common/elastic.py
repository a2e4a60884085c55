"""``horovod.common.elastic``: the framework-independent elastic pieces, from
:mod:`hora.elastic`."""

from hora.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run

run_fn = run  # Horovod's name for the function behind the decorator

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "run",
    "run_fn",
]
