"""Learning-rate helpers for large-batch data-parallel training.

``LinearScalingWarmup`` is a standard torch LR scheduler: the optimizer is configured with the
single-worker learning rate, and the scheduler raises it linearly to ``scale`` times that
(``scale`` defaults to the number of workers) over the first ``warmup_epochs`` epochs, then keeps
it there. It is chainable, so it composes with other schedulers through
``torch.optim.lr_scheduler.ChainedScheduler`` or ``SequentialLR``.

``LARS`` wraps any optimizer (usually SGD with momentum) and rescales each layer's gradient by
its trust ratio ``eta * |w| / (|g| + weight_decay * |w|)`` before the wrapped step, so every layer
moves by a similar relative amount whatever the global learning rate.

Both run in the training thread and are not thread-safe (like torch optimizers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hora.torch.wrapper import OptimizerWrapper


class LinearScalingWarmup(LRScheduler):
    """Ramp every group's lr from its configured value to ``scale`` times it, then hold.

    Args:
        optimizer: the optimizer (or ``DistributedOptimizer``) whose ``lr`` is the one-worker lr.
        warmup_epochs: length of the ramp in epochs (may be fractional; 0 jumps straight to the
            scaled lr).
        steps_per_epoch: how many ``scheduler.step()`` calls make an epoch: 1 when stepping once
            per epoch, ``len(train_loader)`` when stepping after every batch (smoother).
        scale: the target multiplier; default ``hora.size()``, the number of workers.
        last_epoch: the index of the last step taken, to resume (torch's convention).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_epochs: float = 5.0,
        steps_per_epoch: int = 1,
        scale: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        if scale is None:
            import hora

            scale = float(hora.size())
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.warmup_steps = round(warmup_epochs * steps_per_epoch)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The multiplier on the base lr after ``step`` scheduler steps."""
        if self.warmup_steps == 0:
            return self.scale
        return 1.0 + (self.scale - 1.0) * min(max(step, 0), self.warmup_steps) / self.warmup_steps

    def get_lr(self) -> list[Any]:  # type: ignore[override]
        t = self.last_epoch
        current = [group["lr"] for group in self.optimizer.param_groups]
        if self._is_initial and t > 0:
            return current
        if t == 0:
            return [lr * self.factor(0) for lr in current]
        if t > self.warmup_steps:
            return current
        ratio = self.factor(t) / self.factor(t - 1)
        return [lr * ratio for lr in current]

    def _get_closed_form_lr(self) -> list[Any]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]


def _one_dimensional(param: torch.Tensor) -> bool:
    return param.ndim <= 1


class LARS(OptimizerWrapper):
    """Layer-wise adaptive rate scaling around ``optimizer``.

    Before each step every parameter's gradient ``g`` becomes ``ratio * (g + wd * w)`` with
    ``ratio = trust_coefficient * |w| / (|g| + wd * |w| + eps)``; the wrapped optimizer then steps
    with its weight decay switched off (it was folded in). With ``clip=True`` the ratio is
    ``min(ratio / lr, 1)`` instead (LARC's clipping mode), so LARS can only slow a layer down.
    Parameters for which ``exclude(param)`` is true (by default biases and normalisation
    weights, the 1-D ones) keep plain weight decay and no adaptation.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        clip: bool = False,
        exclude: Callable[[torch.Tensor], bool] | None = _one_dimensional,
    ) -> None:
        super().__init__(optimizer)
        if trust_coefficient <= 0:
            raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient}")
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip
        self.exclude = exclude

    @torch.no_grad()
    def _rescale(self, group: dict[str, Any], weight_decay: float) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError("LARS needs dense gradients; use sparse_as_dense=True")
            if self.exclude is not None and self.exclude(p):
                if weight_decay:
                    p.grad.add_(p, alpha=weight_decay)
                continue
            w_norm = torch.linalg.vector_norm(p)
            g_norm = torch.linalg.vector_norm(p.grad)
            ratio = self.trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + self.eps)
            # A zero weight or gradient has no meaningful ratio: leave that layer's rate alone.
            ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
            if self.clip:
                ratio = torch.clamp(ratio / group["lr"], max=1.0)
            if weight_decay:
                p.grad.add_(p, alpha=weight_decay)
            p.grad.mul_(ratio)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = []
        for group in self.param_groups:
            weight_decay = float(group.get("weight_decay", 0.0) or 0.0)
            saved.append(group.get("weight_decay"))
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            self._rescale(group, weight_decay)
        try:
            self.optimizer.step()
        finally:
            for group, wd in zip(self.param_groups, saved):
                if wd is not None:
                    group["weight_decay"] = wd
        return loss
