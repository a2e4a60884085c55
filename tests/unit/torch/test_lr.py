"""LinearScalingWarmup schedule values and LARS' per-layer trust ratio."""

from __future__ import annotations

import pytest
import torch

from hora.torch.lr import LARS, LinearScalingWarmup
from hora.torch.wrapper import OptimizerWrapper


def sgd(lr=0.1, **kw):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3, 2))], lr=lr, **kw)


def lrs(opt, sched, steps):
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    return seen


def test_warmup_ramps_linearly_to_scaled_lr_then_holds():
    opt = sgd(0.1)
    sched = LinearScalingWarmup(opt, warmup_epochs=2, steps_per_epoch=2, scale=4)
    assert lrs(opt, sched, 6) == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4, 0.4])


def test_closed_form_matches_and_zero_warmup_jumps():
    opt = sgd(0.2)
    sched = LinearScalingWarmup(opt, warmup_epochs=0, scale=3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)
    assert sched._get_closed_form_lr() == pytest.approx([0.6])


def test_chains_with_decay_after_warmup():
    opt = sgd(0.1)
    warm = LinearScalingWarmup(opt, warmup_epochs=2, scale=2)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    chained = torch.optim.lr_scheduler.ChainedScheduler([warm, decay])
    seen = []
    for _ in range(4):
        opt.step()
        chained.step()
        seen.append(opt.param_groups[0]["lr"])
    # warm-up factors 1.5, 2, 2, 2 times decay 0.5, 0.25, 0.125, 0.0625
    assert seen == pytest.approx([0.075, 0.05, 0.025, 0.0125])


def test_works_on_a_wrapper_and_validates():
    opt = OptimizerWrapper(sgd(0.1))
    LinearScalingWarmup(opt, warmup_epochs=1, scale=2)
    with pytest.raises(ValueError, match="warmup_epochs"):
        LinearScalingWarmup(sgd(), warmup_epochs=-1, scale=2)
    with pytest.raises(ValueError, match="scale"):
        LinearScalingWarmup(sgd(), scale=0)


def test_lars_scales_each_layer_by_its_trust_ratio():
    w = torch.nn.Parameter(torch.full((4,), 2.0).reshape(2, 2))  # |w| = 4
    b = torch.nn.Parameter(torch.ones(2))  # 1-D: excluded
    inner = torch.optim.SGD([w, b], lr=1.0, weight_decay=0.5)
    opt = LARS(inner, trust_coefficient=0.1, eps=0.0)
    w.grad = torch.full((2, 2), 0.5)  # |g| = 1
    b.grad = torch.ones(2)
    opt.step()
    ratio = 0.1 * 4 / (1 + 0.5 * 4)
    torch.testing.assert_close(w.detach(), torch.full((2, 2), 2.0 - ratio * (0.5 + 0.5 * 2.0)))
    torch.testing.assert_close(b.detach(), torch.ones(2) - (1 + 0.5))
    assert inner.param_groups[0]["weight_decay"] == 0.5  # restored after the step


def test_lars_clip_never_exceeds_the_global_lr():
    w = torch.nn.Parameter(torch.full((2, 2), 100.0))
    opt = LARS(torch.optim.SGD([w], lr=0.01), trust_coefficient=1.0, clip=True)
    w.grad = torch.full((2, 2), 1e-3)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((2, 2), 100.0 - 0.01 * 1e-3))
