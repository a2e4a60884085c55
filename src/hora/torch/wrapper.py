"""``OptimizerWrapper``: an optimizer that adds behaviour around another one by composition.

The wrapper *is* a ``torch.optim.Optimizer`` for ``isinstance`` checks (LR schedulers, gradient
scalers and checkpoint code accept it), but it keeps no parameters or state of its own:
``param_groups``, ``state``, ``defaults``, ``state_dict`` and the step hooks all belong to the
wrapped optimizer, reachable as ``wrapper.optimizer``. Attributes the wrapper does not define are
looked up on the wrapped optimizer, so optimizer-specific fields keep working. The wrapped
optimizer's class is never copied or subclassed. ``isinstance(wrapper, torch.optim.SGD)`` is
therefore False; test ``wrapper.optimizer`` for the concrete type.

Runs in the training thread; as thread-safe as the wrapped optimizer (not at all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OptimizerWrapper(torch.optim.Optimizer):
    """Delegates everything to ``optimizer``; subclasses override ``step``/``zero_grad``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        # Optimizer.__init__ is deliberately not called: the wrapped optimizer owns the
        # parameter groups and state, and the properties below expose them.
        self.optimizer = optimizer

    # -- the wrapped optimizer's data, shared, not copied ---------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # -- behaviour, delegated ------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails. "optimizer" itself must not recurse (it is
        # missing while an instance is being unpickled or constructed).
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


def unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The innermost optimizer below any number of ``OptimizerWrapper`` layers."""
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.optimizer
    return optimizer
