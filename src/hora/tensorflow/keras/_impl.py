"""What ``hora.tensorflow.keras`` and ``hora.keras`` share, written once for any Keras module.

The callbacks are mixins over the Keras world's own ``Callback`` class (Keras 3 or tf_keras;
``callbacks.py`` of each package binds them), so ``model.fit`` accepts them. Callbacks run in
the thread that runs ``fit``; their collectives are eager hora ops, so every rank must run the
same callbacks in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import hora
from hora.frameworks import ops
from hora.frameworks.ops import Average
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import broadcast_variables
from hora.tensorflow.gradients import GradientReducer, variable_key
from hora.tensorflow.keras.optimizer import make_distributed


# -- values ---------------------------------------------------------------------------------
# Horovod's Keras-level collectives take a value (anything ``tf.constant`` takes) and return the
# collective's result: eagerly (TensorFlow 2) the result tensor, in a TensorFlow 1 graph the
# NumPy value of the op run in the Keras session.
def _session() -> Any:
    """The Keras backend's session (tf_keras), else the default one, else a new one."""
    get_session = getattr(getattr(tf.compat.v1.keras, "backend", None), "get_session", None)
    if get_session is not None:
        return get_session()
    return tf.compat.v1.get_default_session() or tf.compat.v1.Session()


def _eval(result: Any) -> Any:
    if tf.executing_eagerly():
        return result
    return _session().run(result)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = Compression.none,
) -> Any:
    from hora.tensorflow.mpi_ops import allreduce as tf_allreduce

    out = tf_allreduce(tf.constant(value, name=name), average=average, compression=compression,
                       op=op, prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor, name=name)  # fmt: skip
    return _eval(out)


def allgather(value: Any, name: str | None = None) -> Any:
    from hora.tensorflow.mpi_ops import allgather as tf_allgather

    return _eval(tf_allgather(tf.constant(value, name=name), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    from hora.tensorflow.mpi_ops import broadcast as tf_broadcast

    return _eval(tf_broadcast(tf.constant(value, name=name), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    from hora.tensorflow.mpi_ops import reducescatter as tf_reducescatter

    return _eval(tf_reducescatter(tf.constant(value, name=name), op=op, name=name))


def broadcast_global_variables(root_rank: int) -> Any:
    """TensorFlow 1 graphs: broadcast every global variable from ``root_rank`` (run in the
    Keras session). Eagerly it raises ``RuntimeError``: use
    ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` in ``model.fit`` or
    ``hvd.broadcast_variables(model.variables, root_rank=0)``."""
    from hora.tensorflow.functions import broadcast_global_variables as tf_broadcast_globals

    return _eval(tf_broadcast_globals(root_rank))


def load_model(keras: Any, filepath: Any, custom_optimizers: Any = None,
               custom_objects: Any = None, compression: Any = Compression.none) -> Any:  # fmt: skip
    """Load a saved model and make its optimizer (with its saved state) distributed."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None:
        make_distributed(opt, GradientReducer(compression=compression))
    return model


# -- callbacks ------------------------------------------------------------------------------
def _optimizer_variables(opt: Any) -> list[Any]:
    if opt is None:
        return []
    vs = opt.variables
    return list(vs() if callable(vs) else vs)


def _is_variable(var: Any) -> bool:
    """A ``tf.Variable`` or a Keras 3 variable (whose value is a ``tf.Variable``)."""
    return isinstance(var, tf.Variable) or isinstance(getattr(var, "value", None), tf.Variable)


class BroadcastGlobalVariablesCallbackImpl:
    """Make every rank start from ``root_rank``'s weights and optimizer state.

    Broadcasts the model's and the optimizer's variables when training begins and once more
    after the first batch (optimizers that create their slots on the first update). The
    model variables in ``local_variables`` (a variable or a list of them) are not broadcast:
    each rank keeps its own (the optimizer's state is broadcast whole, as in Horovod).
    """

    model: Any

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: set[Any] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError(
                "All local variables must be of tf.Variable type: pass local_variables= a "
                "variable or a list of variables (e.g. model.layers[0].variables)"
            )
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: every rank keeps its own value."""
        self._local_vars.add(variable_key(var))

    def _broadcast(self) -> None:
        model_vars = [v for v in self.model.variables if variable_key(v) not in self._local_vars]
        variables = model_vars + _optimizer_variables(getattr(self.model, "optimizer", None))
        broadcast_variables(variables, self.root_rank)

    def on_train_begin(self, logs: Any = None) -> None:
        self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True

    on_batch_end = on_train_batch_end


class MetricAverageCallbackImpl:
    """Average the epoch's metrics (every number in ``logs``) over the ranks, in place.

    Put it before callbacks that read the metrics (checkpointing, early stopping, schedules).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and k != "lr"
                      and k != "learning_rate")  # fmt: skip
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = ops.allreduce(values, op=Average, name=f"metric_average.{epoch}")
        for k, v in zip(keys, averaged.tolist()):
            logs[k] = v


def get_lr(opt: Any) -> float:
    return float(np.asarray(opt.learning_rate))


def set_lr(opt: Any, value: float) -> None:
    lr = opt.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        opt.learning_rate = value


class LearningRateScheduleCallbackImpl:
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` in ``[start_epoch,
    end_epoch)``: at each epoch's start (``staircase``), or at every batch with a fractional
    epoch. ``multiplier`` is a number or a function of the epoch. ``momentum_correction``
    scales a momentum held in a variable by new_lr/old_lr for the step where lr changes (a
    Keras 3 momentum is a Python number compiled into the step: not corrected).
    """

    model: Any
    params: Any

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self._restore_momentum: float | None = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _in_range(self, epoch: float) -> bool:
        return self.start_epoch <= epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        old = get_lr(opt)
        new = self.initial_lr * self.multiplier(epoch)
        set_lr(opt, new)
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old > 0:
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new / old)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = get_lr(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    "could not tell the steps per epoch: pass steps_per_epoch= to the callback"
                )

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.staircase or self.current_epoch is None:
            return
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        if self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = get_lr(self.model.optimizer)


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (the "large minibatch" warm-up)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:  # fmt: skip
        def multiplier(epoch: float) -> float:
            n = hora.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)  # fmt: skip
        self.verbose = verbose
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and hora.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_lr(self.model.optimizer):g}.")  # fmt: skip
