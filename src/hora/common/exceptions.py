"""Horovod's ``horovod.common.exceptions``: the error classes, re-exported from ``hora.errors``."""

from __future__ import annotations

from hora.errors import (
    HorovodInternalError,
    HorovodVersionMismatchError,
    HostsUpdatedInterrupt,
)

__all__ = ["HorovodInternalError", "HorovodVersionMismatchError", "HostsUpdatedInterrupt"]
