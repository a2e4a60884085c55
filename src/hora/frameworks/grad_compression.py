"""Gradient compressors with state, written once on NumPy arrays: the base of PowerSGD and top-k.

Horovod's ``Compression`` is a ``compress``/``decompress`` pair per tensor around one allreduce.
PowerSGD (:mod:`hora.frameworks.powersgd`) and top-k (:mod:`hora.frameworks.topk`) need more:
state per parameter (error-feedback memory, warm-started factors) and collectives of their own
(two allreduces of low-rank factors; an allgather of indices and values). So a
:class:`GradientCompressor` averages a whole step's gradients itself:
``compressor.reduce(grads, process_set)`` takes every parameter's gradient by name (float
NumPy arrays, C-contiguous, updated in place) and leaves the average over the set in them. A
framework binding hands its gradients over as NumPy views (``DistributedOptimizer`` in
``hora.torch``, the gradient tape and Keras optimizer in ``hora.tensorflow``) when its
``compression=`` argument is a compressor instance; Horovod's ``none``/``fp16`` keep their
per-tensor path.

The first ``start_iter`` calls average exactly (an allreduce of every gradient) and keep no
error memory, as the PowerSGD paper advises. Vectors (biases, norms), non-float gradients and
tensors too small to gain (:meth:`GradientCompressor.compresses`) are always averaged exactly,
in one grouped allreduce.

State (:meth:`state_dict`): ``shared`` (the step count and anything every rank holds alike,
such as PowerSGD's factors) and ``local`` (each rank's own error memory). Elastic training
commits and restores both with the optimizer; ``broadcast_optimizer_state`` and an elastic
``sync()`` give every rank the root's shared part and keep each rank's local part (a rank that
has none, a newcomer, starts with zero error memory), so a job that loses a worker goes on with
the same compression state.

Called from the training thread; one compressor per optimizer; not thread-safe.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from hora.collectives.reduce_ops import AVERAGE
from hora.core.process_sets import ProcessSet, global_process_set
from hora.frameworks import ops

COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))


class GradientCompressor:
    """Averages a step's named gradients over a process set, with state kept between steps.

    Subclasses implement :meth:`compresses` and :meth:`_reduce_compressed`; their per-parameter
    state lives in ``self.shared`` and ``self.local`` (dicts of dicts of NumPy arrays)."""

    kind = "compressor"

    def __init__(self, start_iter: int = 0) -> None:
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.start_iter = start_iter
        self.step = 0
        self.shared: dict[str, dict[str, np.ndarray]] = {}
        self.local: dict[str, dict[str, np.ndarray]] = {}
        self.bytes_sent = 0  # payload bytes this rank put into the last step's collectives

    # -- what subclasses define ------------------------------------------------------------
    def compresses(self, grad: np.ndarray) -> bool:
        """Whether ``grad`` is compressed (else averaged exactly). The same on every rank."""
        raise NotImplementedError

    def _reduce_compressed(self, grads: dict[str, np.ndarray], ps: ProcessSet) -> None:
        """Average ``grads`` (all compressible) over ``ps`` in place, with error feedback."""
        raise NotImplementedError

    # -- the step ---------------------------------------------------------------------------
    def reduce(self, grads: dict[str, np.ndarray], process_set: ProcessSet | None = None) -> None:
        """Average ``grads`` (name -> float array, C-contiguous, written in place) over the
        process set. Every rank passes the same names, shapes and dtypes in the same order."""
        ps = global_process_set if process_set is None else process_set
        for name, g in grads.items():
            if not isinstance(g, np.ndarray) or not g.flags.c_contiguous or not g.flags.writeable:
                raise TypeError(f"gradient {name!r}: a writable C-contiguous NumPy array needed")
        self.bytes_sent = 0
        compressed = {}
        if self.step >= self.start_iter:
            compressed = {n: g for n, g in grads.items() if self.compresses(g)}
        exact = [g for n, g in grads.items() if n not in compressed and g.size]
        # the exact ones go first and are waited for last: their round runs in the engine
        # while this thread compresses the others
        handle = None
        if exact:
            handle = ops.grouped_allreduce_async(exact, outputs=exact, op=AVERAGE,
                                                 process_set=ps, name=f"hora.{self.kind}.exact")
            self.bytes_sent += sum(g.nbytes for g in exact)
        if compressed:
            self._reduce_compressed(compressed, ps)
        if handle is not None:
            ops.synchronize(handle)
        self.step += 1

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state: ``{"step", "shared", "local"}``."""
        return copy.deepcopy({"step": self.step, "shared": self.shared, "local": self.local})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.shared = copy.deepcopy(state["shared"])
        self.local = copy.deepcopy(state["local"])

    def shared_state(self) -> dict[str, Any]:
        """What every rank should hold alike (a broadcast sends the root's)."""
        return copy.deepcopy({"step": self.step, "shared": self.shared})

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Take the root's shared state; keep this rank's own error memory."""
        self.step = int(state["step"])
        self.shared = copy.deepcopy(state["shared"])

    def _memory(self, name: str, key: str, like: np.ndarray) -> np.ndarray:
        """This rank's ``key`` array for ``name`` (zeros like ``like`` the first time)."""
        slot = self.local.setdefault(name, {})
        mem = slot.get(key)
        if mem is None or mem.shape != like.shape or mem.dtype != like.dtype:
            mem = slot[key] = np.zeros_like(like)
        return mem


def is_gradient_compressor(compression: Any) -> bool:
    """Whether a ``compression=`` argument is a stateful compressor (else a Horovod pair)."""
    return isinstance(compression, GradientCompressor)
