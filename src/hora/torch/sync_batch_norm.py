"""``SyncBatchNorm``: batch normalisation with statistics over the whole global batch.

Works on CPU and GPU tensors alike. In training, every rank contributes its sample count, mean
and sum of squared deviations per channel (one allgather); they are combined exactly (the
parallel variance formula), so the result equals ``BatchNorm`` over the concatenated batch even
when ranks hold different numbers of samples. Backward sum-allreduces the per-channel sums of
``dy`` and ``dy * x_hat``; the weight and bias gradients stay local (the optimizer averages
them). In eval mode, or on a single rank, it is plain ``BatchNorm``.

Runs in the training thread (forward) and autograd's thread (backward); every rank of the set
must run the same layers in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from hora import global_process_set
from hora.frameworks.ops import Sum
from hora.torch.mpi_ops import ProcessSet, allgather_async, allreduce_async, synchronize


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFn(Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, eps, momentum, process_set):  # type: ignore[override]
        channels = x.shape[1]
        dims = [0, *range(2, x.ndim)]
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(stat_dtype)
        count = x.numel() // channels if channels else 0
        if count:
            local_mean = xs.mean(dims)
            local_m2 = ((xs - _channel_view(local_mean, x.ndim)) ** 2).sum(dims)
        else:
            local_mean = local_m2 = torch.zeros(channels, dtype=stat_dtype, device=x.device)
        packed = torch.cat([local_mean.new_tensor([float(count)]), local_mean, local_m2])
        h = allgather_async(packed.unsqueeze(0), "sync_batch_norm.stats", process_set)
        everyone = synchronize(h).to(x.device)
        counts, means, m2s = (
            everyone[:, :1],
            everyone[:, 1 : 1 + channels],
            everyone[:, 1 + channels :],
        )
        total = counts.sum()
        if total == 0:
            raise ValueError("SyncBatchNorm got no samples on any rank")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            unbiased = m2 / (total - 1) if total > 1 else m2 / total
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        x_hat = (xs - _channel_view(mean, x.ndim)) * _channel_view(invstd, x.ndim)
        y = x_hat
        if weight is not None:
            y = y * _channel_view(weight.to(stat_dtype), x.ndim)
        if bias is not None:
            y = y + _channel_view(bias.to(stat_dtype), x.ndim)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.total, ctx.process_set, ctx.has_bias = total, process_set, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_hat, weight, invstd = ctx.saved_tensors
        ndim = x_hat.ndim
        dims = [0, *range(2, ndim)]
        dys = dy.to(x_hat.dtype)
        sum_dy = dys.sum(dims)
        sum_dy_xhat = (dys * x_hat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:
            packed = torch.cat([sum_dy, sum_dy_xhat])
            h = allreduce_async(
                packed, None, "sync_batch_norm.grad", Sum, 1.0, 1.0, ctx.process_set
            )
            g_dy, g_dy_xhat = synchronize(h).to(dy.device).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = (
                dys
                - _channel_view(g_dy / ctx.total, ndim)
                - x_hat * _channel_view(g_dy_xhat / ctx.total, ndim)
            ) * _channel_view(scale, ndim)
            grad_x = grad_x.to(dy.dtype)
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_b = (
            sum_dy.to(weight.dtype if weight is not None else dy.dtype) if ctx.has_bias else None
        )
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that normalises over every rank's samples.

    Same arguments as ``BatchNorm``; ``process_set`` limits the synchronisation to a subset of
    ranks. Input: ``(N, C, *)`` with at least two dimensions.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = global_process_set if process_set is None else process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats or self.process_set.size() == 1:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch_stats,
                momentum,
                self.eps,
            )
        running = self.track_running_stats and self.training
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if running else None,
            self.running_var if running else None,
            self.eps,
            momentum,
            self.process_set,
        )
