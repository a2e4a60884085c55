"""``horovod.common.util``: what this installation was built with, and small helpers, with
Horovod's names and signatures.

Horovod answers the ``*_built`` questions by loading its compiled extension for each framework
in a child process; hora is pure Python, so the answers come from what is installed (the same
answers ``hora.mpi_built()`` and friends give). ``gpu_available(ext_base_name)`` is True when
``hora.<ext_base_name>`` exists and its framework sees a GPU. Nothing here raises for a missing
or broken framework: it answers False. hora builds no extension against a framework version, so
``check_installed_version`` never finds a mismatch, and ``check_extension`` asks whether hora's
binding for the framework can be imported instead of looking for a compiled library. Thread-safe
(the caches are filled idempotently).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from typing import Any

EXTENSIONS = ["tensorflow", "torch", "mxnet"]


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``hora.<ext_base_name>`` (``torch``, ``tensorflow``, ...) and its framework can
    be imported."""
    try:
        importlib.import_module(f"hora.{ext_base_name}")
    except Exception as e:
        if verbose:
            print(f"Extension {ext_base_name} was NOT built: {e}")
        return False
    if verbose:
        print(f"Extension {ext_base_name} was built.")
    return True


def _framework_gpu(ext_base_name: str) -> bool:
    if ext_base_name == "torch":
        import torch

        return bool(torch.cuda.is_available())
    if ext_base_name in ("tensorflow", "keras"):
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False


@functools.cache
def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``hora.<ext_base_name>`` can run with a GPU: it exists and its framework sees a
    CUDA/ROCm device. False (never an exception) otherwise."""
    if not _has(f"hora.{ext_base_name}"):
        result = False
    else:
        try:
            result = _framework_gpu(ext_base_name)
        except Exception:
            result = False
    if verbose:
        was = "was" if result else "was NOT"
        print(f"Extension {ext_base_name} {was} running with GPU.")
    return result


def _hora_answer(name: str) -> Any:
    import hora

    return getattr(hora, name)()


@functools.cache
def mpi_built(verbose: bool = False) -> bool:
    return bool(_hora_answer("mpi_built"))


@functools.cache
def gloo_built(verbose: bool = False) -> bool:
    return bool(_hora_answer("gloo_built"))


@functools.cache
def nccl_built(verbose: bool = False) -> int:
    return int(_hora_answer("nccl_built"))


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


@contextlib.contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set environment variables (those given as None are left alone) inside the block."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's requirement)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(l: list[Any], n: int) -> list[list[Any]]:  # noqa: E741 (Horovod's name)
    """``l`` in ``n`` consecutive chunks whose sizes differ by at most one."""
    size, extra = divmod(len(l), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [l[bounds[i] : bounds[i + 1]] for i in range(n)]


def is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


@functools.cache
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version string ``ver`` is at least ``target`` (``major.minor.patch``)."""
    from packaging import version

    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(
            f"is_version_greater_equal_than takes two version strings, got {type(ver).__name__} "
            f"{ver!r} and {type(target).__name__} {target!r}"
        )
    if len(target.split(".")) != 3:
        raise ValueError(f"target must be a version of the form major.minor.patch, got {target!r}")
    return version.parse(ver) >= version.parse(target)


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], Any]:
    """A function ``(op, average) -> op`` for APIs that still take the deprecated ``average=``.

    ``reduce_ops`` is anything with ``Average`` and ``Sum`` attributes (``hora.torch``, a
    framework's ``mpi_ops``). Given ``op``, the function returns it (ValueError if ``average``
    was given too); given only ``average``, it warns (DeprecationWarning) and returns
    ``reduce_ops.Average`` for a true value, ``reduce_ops.Sum`` for a false one; given neither,
    ``reduce_ops.Average``.
    """

    def pick(op: Any, average: Any) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError(
                    "The op parameter supersedes average. Please provide only one of them."
                )
            return op
        if average is not None:
            warnings.warn(
                "the average= argument is deprecated and will be removed: pass op=Average "
                "or op=Sum instead",
                DeprecationWarning,
                stacklevel=2,
            )
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return pick


def get_version_mismatch_message(name: str, version: str, installed_version: Any) -> str:
    return (
        f"Framework {name} installed with version {installed_version} but found version "
        f"{version}. This can cause runtime errors: reinstall the package built against {name}."
    )


def check_installed_version(name: str, version: str, exception: Any = None) -> None:
    """Horovod compares ``version`` with the framework version its extension was compiled
    against, and warns (or, given the import ``exception``, raises HorovodVersionMismatchError)
    on a mismatch. hora compiles nothing against a framework, so no version can mismatch: this
    returns None, and a caller holding ``exception`` goes on to raise that original error."""
    if not isinstance(name, str) or not isinstance(version, str):
        raise TypeError(
            f"check_installed_version takes a framework name and its version as strings, got "
            f"{name!r} and {version!r}"
        )
    return None


def get_ext_suffix() -> str:
    """The file name suffix of a compiled Python extension on this interpreter."""
    return sysconfig.get_config_var("EXT_SUFFIX") or sysconfig.get_config_var("SO") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """Where a compiled extension named ``args[-1]`` would lie, in folder ``args[:-1]`` next to
    the file ``pkg_path``."""
    if not args:
        raise ValueError("get_extension_full_path needs at least the extension's name")
    folder = os.path.join(os.path.dirname(pkg_path), *args[:-1])
    return os.path.join(folder, args[-1] + get_ext_suffix())


_FRAMEWORK_OF = {"torch": "torch", "tensorflow": "tensorflow", "keras": "keras", "mxnet": "mxnet"}


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """ImportError unless extension ``ext_name`` (``"horovod.torch"``, ``"hora.tensorflow"``)
    can be used. A compiled library at ``get_extension_full_path(pkg_path, *args)`` counts; so
    does hora's pure-Python binding for the framework when the framework is installed."""
    full_path = get_extension_full_path(pkg_path, *args) if args else None
    if full_path is not None and os.path.exists(full_path):
        return
    binding = ext_name.rpartition(".")[2]
    framework = _FRAMEWORK_OF.get(binding)
    if framework is not None and _has(f"hora.{binding}") and _has(framework):
        return
    if framework is None or not _has(f"hora.{binding}"):
        raise ImportError(
            f"Extension {ext_name} is not available: hora has no binding named {binding!r} "
            f"(hora binds {', '.join(sorted(b for b in _FRAMEWORK_OF if _has('hora.' + b)))}); "
            f"{ext_env_var} does not apply to hora, which compiles nothing"
        )
    raise ImportError(
        f"Extension {ext_name} is not available: hora.{binding} needs the {framework} package, "
        f"which is not installed; install it (pip install {framework})"
    )
