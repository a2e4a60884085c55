"""``hora.common``: where Horovod scripts import ``horovod.common``'s public pieces from.

``from horovod.common.exceptions import HorovodInternalError`` becomes
``from hora.common.exceptions import HorovodInternalError``, and
``from horovod.common.process_sets import ProcessSet`` becomes
``from hora.common.process_sets import ProcessSet``. These modules only re-export what lives
elsewhere in hora (``hora.errors``, ``hora.core.process_sets``, ``hora.frameworks.ops``).
"""
