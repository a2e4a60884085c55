"""Horovod's module names for hora's modules, for scripts that keep ``import horovod.torch``.

Off unless asked for: ``hora run --as-horovod`` (its workers), or ``HORA_AS_HOROVOD=1`` in the
environment of a process that hora run does not start (a Spark or Ray worker). Then
``horovod`` is ``hora`` and every ``horovod.<name>`` is ``hora.<name>`` when hora has that
module (``horovod.torch``, ``horovod.torch.mpi_ops``, ``horovod.common.util``,
``horovod.runner``, ``horovod.tensorflow``, ...): the same module objects, so classes, errors
and state are shared whichever name imported them. A name hora has no module for fails as a
missing module does. Without it, hora makes nothing named ``horovod`` importable and never
hides a real Horovod installation.

How a process turns it on: :func:`install` puts :class:`HorovodAliases` first on
``sys.meta_path``. ``hora run --as-horovod`` puts :func:`shim_path` first on the workers'
``PYTHONPATH``: a folder whose only content is a ``horovod`` package that calls :func:`install`
and stands aside for ``hora``. An installed hora also reads ``HORA_AS_HOROVOD`` at interpreter
start (the ``hora-as-horovod.pth`` file calls :func:`startup`). Import-time only; thread-safe
as the import system is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENV = "HORA_AS_HOROVOD"


def target(name: str) -> str | None:
    """hora's module for Horovod's module ``name`` (None: not a horovod name)."""
    if name != "horovod" and not name.startswith("horovod."):
        return None
    return "hora" + name[len("horovod") :]


class _Alias(importlib.abc.Loader):
    """Loads ``horovod.X`` as the module object of ``hora.X`` itself."""

    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.real)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is hora's, already imported."""


class HorovodAliases(importlib.abc.MetaPathFinder):
    """``sys.meta_path`` entry answering ``horovod`` names with hora's modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target_: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = target(fullname)
        if real is None:
            return None
        try:
            found = importlib.util.find_spec(real)
        except (ImportError, ValueError):
            found = None
        if found is None:
            return None  # hora has no such module: import fails as for any missing module
        return importlib.machinery.ModuleSpec(
            fullname, _Alias(real), is_package=found.submodule_search_locations is not None
        )


def installed() -> bool:
    return any(isinstance(f, HorovodAliases) for f in sys.meta_path)


def install() -> None:
    """Turn the aliases on in this process (idempotent). A ``horovod`` module imported before
    (a real Horovod) is dropped from ``sys.modules``, so later imports get hora's."""
    if not installed():
        sys.meta_path.insert(0, HorovodAliases())
    for name in [n for n in sys.modules if target(n) is not None]:
        module = sys.modules[name]
        if not getattr(module, "__name__", "").startswith("hora"):
            del sys.modules[name]


def uninstall() -> None:
    """Turn them off again: the finder and every ``horovod`` name it made go."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodAliases)]
    for name in [n for n in sys.modules if target(n) is not None]:
        del sys.modules[name]


def shim_path() -> str:
    """The folder ``hora run --as-horovod`` puts first on the workers' ``PYTHONPATH``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_horovod")


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on", "y", "t")


def startup() -> None:
    """At interpreter start (the ``.pth`` file): install when ``HORA_AS_HOROVOD`` is on."""
    if enabled():
        install()


if __name__ == "__main__":
    # `python -m hora.as_horovod`: the folder to put on PYTHONPATH by hand
    print(shim_path())
