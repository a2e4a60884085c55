"""``hvd.elastic`` for TensorFlow: Horovod's ``horovod.tensorflow.elastic`` on hora.

- ``run(func)``: ``hora.elastic.run``, where a collective that failed inside ``tf.function``
  (TensorFlow reports it as an ``OpError`` carrying hora's ``HoraInternalError``) counts as the
  ``HorovodInternalError`` it is, so the job rolls back to the last commit.
- ``TensorFlowState(variables, **kwargs)``: a list of variables plus plain values.
- ``TensorFlowKerasState(model, optimizer=None, **kwargs)``: a Keras model's and optimizer's
  variables plus plain values (``KerasState`` in the Keras modules).

Both keep a stateful compressor's state (PowerSGD's factors and error memory, top-k's memory,
the step count) with the variables: the Keras optimizer's, and any keyword value that is
such a compressor or carries one (a ``DistributedGradientTape``, a distributed optimizer).
Those values are held as they are, not copied as plain values. ``sync()`` gives every rank
rank 0's shared part (the factors, the step) and leaves each rank its own error memory, as
``broadcast_optimizer_state`` does in ``hora.torch``.
- ``CommitStateCallbackImpl``, ``UpdateBatchStateCallbackImpl``,
  ``UpdateEpochStateCallbackImpl``: the Keras elastic callbacks, bound to each Keras world's
  ``Callback`` in ``hora.tensorflow.keras.elastic`` and ``hora.keras.elastic``.

``save()`` (and ``commit()``) keeps NumPy copies of the variables in memory, ``restore()``
assigns them back, ``sync()`` gives every rank rank 0's values (one grouped broadcast). Used
from the training thread; not thread-safe. ``sync()`` is collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

import hora
from hora.elastic.run import run as _run
from hora.elastic.state import ObjectState, State
from hora.errors import HoraInternalError, HorovodInternalError, HostsUpdatedInterrupt
from hora.frameworks.grad_compression import GradientCompressor
from hora.tensorflow.functions import broadcast_object, broadcast_variables

F = TypeVar("F", bound=Callable[..., Any])


def _is_hora_failure(error: tf.errors.OpError) -> bool:
    return "HoraInternalError" in str(error.message)


def _hora_message(text: str) -> str:
    """hora's own message out of TensorFlow's report (which wraps it in a graph trace)."""
    for line in text.splitlines():
        if "HoraInternalError: " in line:
            return line.split("HoraInternalError: ", 1)[1].strip()
    return text.strip().splitlines()[0] if text.strip() else "a collective failed"


def run(func: F) -> F:
    """Run ``func(state, *args, **kwargs)`` until it returns, recovering from lost workers
    (see ``hora.elastic.run``); TensorFlow's report of a failed collective counts too."""

    @functools.wraps(func)
    def translated(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            if _is_hora_failure(e):
                raise HoraInternalError(_hora_message(str(e.message))) from e
            raise

    return _run(translated)  # type: ignore[return-value]


def _values(variables: list[Any]) -> list[np.ndarray]:
    # through .numpy() (TensorFlow's and Keras 3's variables): np.array of a Keras 3 variable
    # warns under NumPy 2 (its __array__ takes no copy keyword)
    return [np.array(v.numpy() if hasattr(v, "numpy") else v) for v in variables]


def _assign(variables: list[Any], values: list[np.ndarray] | None) -> None:
    if values is None or len(values) != len(variables):
        return  # saved before the variables existed (an optimizer not yet built)
    for v, value in zip(variables, values):
        v.assign(value)


def _compressor_of(value: Any) -> GradientCompressor | None:
    """The stateful compressor ``value`` is or carries (a tape or a Keras optimizer made
    distributed, a TensorFlow 1 ``DistributedOptimizer``); None for anything else."""
    if isinstance(value, GradientCompressor):
        return value
    for attr in ("_hora_reducer", "_reducer"):
        found = getattr(getattr(value, attr, None), "compression", None)
        if isinstance(found, GradientCompressor):
            return found
    return None


def _plain_and_held(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A state's keywords: the plain values, and those that are or carry a stateful
    compressor (kept as they are, their compressor's state saved with the variables)."""
    held = {k: v for k, v in kwargs.items() if _compressor_of(v) is not None}
    return {k: v for k, v in kwargs.items() if k not in held}, held


class _Compressors:
    """Stateful compressors' part of an elastic state (see the module doc)."""

    def __init__(self, holders: list[Any]) -> None:
        found = (_compressor_of(h) for h in holders)
        self.compressors = list({id(c): c for c in found if c is not None}.values())
        self.saved = [c.state_dict() for c in self.compressors]

    def save(self) -> None:
        self.saved = [c.state_dict() for c in self.compressors]

    def restore(self) -> None:
        for c, state in zip(self.compressors, self.saved):
            c.load_state_dict(state)

    def sync(self) -> None:
        for i, c in enumerate(self.compressors):
            shared = c.shared_state() if hora.rank() == 0 else None
            c.load_shared_state(broadcast_object(shared, 0, name=f"hora.elastic.compression.{i}"))
        self.save()


class TensorFlowState(ObjectState):
    """Elastic state of variables and plain values: ``TensorFlowState(variables, **kwargs)``.

    A keyword value that is or carries a stateful compressor (``compression=hvd.Compression.
    powersgd(...)`` given to the tape) keeps its state with the variables (module doc).
    ``session`` (TensorFlow 1) is accepted and ignored.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        self._saved_variables: list[np.ndarray] | None = None
        plain, held = _plain_and_held(kwargs)
        super().__init__(broadcast_object, hora.rank, **plain)
        self.__dict__.update(held)
        self._compressors = _Compressors(list(held.values()))
        self._saved_variables = _values(self.variables)

    def save(self) -> None:
        self._saved_variables = _values(self.variables)
        self._compressors.save()
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_variables)
        self._compressors.restore()
        super().restore()

    def sync(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._saved_variables = _values(self.variables)
        self._compressors.sync()
        super().sync()


def _optimizer_variables(opt: Any) -> list[Any]:
    if opt is None:
        return []
    vs = opt.variables
    return list(vs() if callable(vs) else vs)


class TensorFlowKerasState(ObjectState):
    """Elastic state of a Keras model: ``TensorFlowKerasState(model, optimizer=None,
    backend=None, **kwargs)`` (the optimizer defaults to the model's)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:  # fmt: skip
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model: list[np.ndarray] | None = None
        self._saved_optimizer: list[np.ndarray] | None = None
        plain, held = _plain_and_held(kwargs)
        super().__init__(broadcast_object, hora.rank, **plain)
        self.__dict__.update(held)
        self._compressors = _Compressors([self.optimizer, *held.values()])
        self._save_variables()

    def _build_optimizer(self) -> None:
        """Create the optimizer's variables, so that new workers have as many as the others."""
        opt = self.optimizer
        trainable = list(self.model.trainable_variables)
        if opt is None or not trainable:
            return
        # Keras 3 says ``built``; tf_keras's optimizer has ``_built`` only once built (so a
        # new worker's optimizer had no slots and broadcast fewer variables than the others);
        # tf_keras's legacy OptimizerV2 makes its slots in _create_all_weights
        if getattr(opt, "built", False) or getattr(opt, "_built", False):
            return
        if hasattr(opt, "build"):
            opt.build(trainable)
        elif hasattr(opt, "_create_all_weights"):
            opt._create_all_weights(trainable)

    def _save_variables(self) -> None:
        self._saved_model = _values(list(self.model.variables))
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
        self._compressors.save()

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        _assign(list(self.model.variables), self._saved_model)
        _assign(_optimizer_variables(self.optimizer), self._saved_optimizer)
        self._compressors.restore()
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        variables = list(self.model.variables) + _optimizer_variables(self.optimizer)
        if variables:
            broadcast_variables(variables, root_rank=0)
        self._compressors.sync()
        self._save_variables()
        super().sync()


# -- Keras callbacks (mixins over a Keras world's Callback) --------------------------------
class CommitStateCallbackImpl:
    """Commit the state every ``batches_per_commit`` batches and at the end of each epoch.

    The count starts again at every ``fit`` (``on_train_begin``): a commit that raised
    ``HostsUpdatedInterrupt`` left it at zero, and a callback given to the ``fit`` after the
    reset would otherwise never commit at a batch again, while a new worker's would, and the
    ranks' collectives no longer match.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallbackImpl:
    """Keep ``state.batch``: the index of the last finished batch of the epoch (0 again at
    the epoch's end). With ``steps_per_epoch`` given to ``fit``, the first epoch after a reset
    is told the batches left of it (``params['steps']``, as Horovod does)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - int(getattr(self.state, "batch", 0))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallbackImpl:
    """Keep ``state.epoch``: the number of finished epochs, counting those before this ``fit``
    (call ``fit(epochs=total - state.epoch)`` inside the elastic function)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = int(getattr(state, "epoch", 0))

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = int(getattr(self.state, "epoch", 0))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]


__all__ = [
    "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
    "TensorFlowKerasState", "TensorFlowState", "run",
]  # fmt: skip
