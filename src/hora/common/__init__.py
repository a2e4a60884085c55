"""``hora.common``: the framework-independent pieces under the module names Horovod gives them
in ``horovod.common`` (``util``, ``exceptions``, ``process_sets``, ``elastic``), so that code
written against ``horovod.common`` works after changing the import (or unchanged, with
``hora run --as-horovod``). Re-exports only; the implementations live in ``hora.core``,
``hora.errors`` and ``hora.elastic``.
"""
