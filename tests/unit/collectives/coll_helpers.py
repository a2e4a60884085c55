"""Helpers for the collective tests: run a function on every rank of a loopback world."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hora.collectives.reduce_ops import f32_to_bf16
from hora.dtypes import storage_dtype
from hora.transport.loopback import LoopbackTransport, LoopbackWorld


def run_ranks(size: int, fn: Callable[[LoopbackTransport], Any]) -> list[Any]:
    """``fn(transport)`` on one thread per rank of a fresh loopback world; results by rank."""
    world = LoopbackWorld(size, timeout=30.0)
    try:
        return world.run(fn, timeout=60.0)
    finally:
        world.close()


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Exactly representable ``values`` (any numeric array) in ``dtype``'s storage."""
    if dtype == "bfloat16":
        return f32_to_bf16(np.asarray(values, np.float32))
    return np.asarray(values).astype(storage_dtype(dtype))
