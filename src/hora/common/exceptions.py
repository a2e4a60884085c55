"""``horovod.common.exceptions``: the error classes scripts catch, from :mod:`hora.errors`."""

from hora.errors import (
    HorovodInternalError,
    HorovodVersionMismatchError,
    HostsUpdatedInterrupt,
)

__all__ = ["HorovodInternalError", "HorovodVersionMismatchError", "HostsUpdatedInterrupt"]
