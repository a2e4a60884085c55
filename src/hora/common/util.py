"""``horovod.common.util``: what this installation was built with, and small helpers, with
Horovod's names and signatures.

Horovod answers the ``*_built`` questions by loading its compiled extension for each framework
in a child process; hora is pure Python, so the answers come from what is installed (the same
answers ``hora.mpi_built()`` and friends give). ``gpu_available(ext_base_name)`` is True when
``hora.<ext_base_name>`` exists and its framework sees a GPU. Nothing here raises for a missing
or broken framework: it answers False. Thread-safe (the caches are filled idempotently).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
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


def split_list(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` consecutive chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(n)]


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
