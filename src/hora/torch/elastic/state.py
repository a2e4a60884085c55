"""``hvd.elastic``'s PyTorch state: Horovod's ``horovod.torch.elastic.state`` on hora.

``TorchState(model, optimizer, **kwargs)`` keeps a model, an optimizer, samplers and plain values
across resets: ``save()`` (and ``commit()``) keeps deep copies in memory, ``restore()`` loads
them back after a failed collective, ``sync()`` gives every rank rank 0's values. Each value is
kept by the handler registered for its type (modules, optimizers, samplers); anything else is a
plain value, deep-copied and broadcast pickled as in ``ObjectState``. A handler class is built
as Horovod builds it, ``handler_cls(value)``, so handlers written for Horovod (``save``,
``restore``, ``sync``, ``set_value``, ``value``) work here; ``on_reset()`` is optional.

Used from the training thread; not thread-safe. ``sync()`` is collective.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import hora
from hora.elastic.run import run
from hora.elastic.state import ObjectState, State
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt
from hora.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hora.torch.sampler import DistributedSampler, ElasticSampler


class StateHandler:
    """Keeps one value of a :class:`TorchState` through its ``state_dict``.

    ``TorchState`` sets ``name`` (the attribute it keeps) after building the handler.
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self.name = ""
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # a copy again: load_state_dict may keep the very tensors it is given
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        raise NotImplementedError

    def on_reset(self) -> None:
        """Called after hora was initialised again (before the reset callbacks)."""


class ModelStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def _drop_in_flight(self) -> None:
        drop = getattr(self.value, "_drop_in_flight", None)  # hora's DistributedOptimizer
        if drop is not None:
            drop()

    def restore(self) -> None:
        self._drop_in_flight()
        super().restore()

    def sync(self) -> None:
        self._drop_in_flight()
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(StateHandler):
    def sync(self) -> None:
        name = f"hora.elastic.scheduler.{self.name}"
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name=name))


class SamplerStateHandler(StateHandler):
    def sync(self) -> None:
        name = f"hora.elastic.sampler.{self.name}"
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name=name))

    def on_reset(self) -> None:
        if isinstance(self.value, ElasticSampler):
            self.value.reset()


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (DistributedSampler, SamplerStateHandler),  # ElasticSampler included
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """``(type, handler class)`` pairs; the first whose type a value has keeps that value."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _get_handler(value: Any) -> Any:
    """A handler for ``value`` from the first registry entry whose type it has, else None."""
    for kind, cls in _handler_registry:
        if isinstance(value, kind):
            return cls(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a PyTorch job: ``TorchState(model=None, optimizer=None, **kwargs)``.

    ``model``, ``optimizer`` and every keyword become attributes (``state.epoch``...); assigning
    a new model or optimizer to its attribute makes the state keep the new one.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in {"model": model, "optimizer": optimizer, **kwargs}.items():
            handler = _get_handler(value)
            if handler is None:
                plain[name] = value
            else:
                handler.name = name
                handlers[name] = handler
        self._handlers = handlers
        super().__init__(broadcast_object, hora.rank, **plain)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None:
            handler.set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def on_reset(self) -> None:
        for handler in self._handlers.values():
            hook = getattr(handler, "on_reset", None)  # Horovod's handlers have none
            if hook is not None:
                hook()
        super().on_reset()


__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "LRSchedulerStateHandler",
    "ModelStateHandler",
    "ObjectState",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "State",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "run",
    "set_handler_registry",
]
