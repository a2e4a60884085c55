"""OptimizerWrapper shares the wrapped optimizer's groups and state and passes isinstance."""

from __future__ import annotations

import pytest
import torch

from hora.torch.wrapper import OptimizerWrapper, unwrap


def test_wrapper_delegates_and_is_an_optimizer():
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = OptimizerWrapper(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert opt.state is inner.state and len(inner.state) == 2
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5
    assert opt.defaults["momentum"] == 0.9
    inner.custom_field = 3
    assert opt.custom_field == 3
    opt.zero_grad()
    assert model.weight.grad is None
    assert unwrap(OptimizerWrapper(opt)) is inner


def test_wrapper_rejects_non_optimizers():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OptimizerWrapper([1, 2])
