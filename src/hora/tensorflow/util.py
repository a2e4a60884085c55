"""Small TensorFlow helpers that Horovod's ``horovod.tensorflow.util`` offers, under its names.

Scripts and test suites written for Horovod import ``_executing_eagerly`` and the variable
reference helpers from here; they run in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf


def _executing_eagerly() -> bool:  # Horovod's name
    """True in eager mode, False while building a graph (TF1 graphs and tf.function)."""
    return bool(tf.executing_eagerly())


def vars_to_refs(variables: Iterable[Any]) -> list[Any]:
    """Hashable references of ``variables`` (for sets and dict keys)."""
    return [v.ref() for v in variables]


def refs_to_vars(refs: Iterable[Any]) -> list[Any]:
    """The variables behind ``refs`` (the inverse of ``vars_to_refs``)."""
    return [r.deref() for r in refs]


__all__ = ["_executing_eagerly", "refs_to_vars", "vars_to_refs"]
