"""Stand-in found first on ``sys.path`` when hora runs Horovod scripts unchanged
(``hora run --as-horovod``): turns on :mod:`hora.as_horovod` and hands the name ``horovod`` to
``hora``, so this module is never seen by the script."""

import sys

from hora.as_horovod import install

install()
import hora  # noqa: E402

sys.modules[__name__] = hora
