"""Horovod's ``horovod.common.process_sets``: process sets, re-exported from hora's core and
op surface."""

from __future__ import annotations

from hora.core.process_sets import ProcessSet, global_process_set
from hora.frameworks.ops import add_process_set, remove_process_set

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
