"""``horovod.common.process_sets``: process sets, from :mod:`hora.core.process_sets` and the op
surface."""

from hora.core.process_sets import ProcessSet, global_process_set
from hora.frameworks.ops import add_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
