"""HorovodAllreduce, the autograd Function behind hora.torch.allreduce, takes exactly Horovod's
``apply`` arguments; hora's scheduling ``priority`` goes through a Function of its own. Runs
hora as a world of one in this process."""

from __future__ import annotations

import pytest
import torch

import hora.torch as hvd
from hora.torch.mpi_ops import HorovodAllreduce


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def test_horovods_apply_reduces_and_differentiates() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = HorovodAllreduce.apply(x, None, "fn.direct", hvd.Sum, 3.0, 1.0, hvd.global_process_set)
    assert out.tolist() == [3.0, 6.0]
    assert type(out.grad_fn).__name__ == "HorovodAllreduceBackward"
    out.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [3.0, 3.0]  # prescale applies to grads
    with pytest.raises(TypeError):  # nothing after Horovod's arguments
        HorovodAllreduce.apply(x, None, "fn.extra", hvd.Sum, 1.0, 1.0, hvd.global_process_set, 1)


def test_allreduce_with_a_priority_still_differentiates() -> None:
    x = torch.tensor([4.0], requires_grad=True)
    out = hvd.allreduce(x, name="fn.prio", op=hvd.Sum, postscale_factor=2.0, priority=5)
    assert out.tolist() == [8.0]
    assert type(out.grad_fn).__name__ != "HorovodAllreduceBackward"  # hora's own Function
    out.backward(torch.tensor([1.0]))
    assert x.grad is not None and x.grad.tolist() == [2.0]
    plain = hvd.allreduce(x, name="fn.plain")
    assert type(plain.grad_fn).__name__ == "HorovodAllreduceBackward"


def test_without_gradients_the_op_runs_alone() -> None:
    """A tensor that needs no gradient (or any under ``torch.no_grad``) skips autograd's
    Function: the same result, and nothing recorded."""
    x = torch.tensor([1.0, 2.0])
    out = hvd.allreduce(x, name="fn.nograd", op=hvd.Sum, prescale_factor=2.0, priority=3)
    assert out.tolist() == [2.0, 4.0] and out.grad_fn is None and not out.requires_grad
    assert x.tolist() == [1.0, 2.0]  # a new tensor, the input as it was
    w = torch.tensor([1.0], requires_grad=True)
    with torch.no_grad():
        got = hvd.allreduce(w, name="fn.nograd.ctx", op=hvd.Average)
    assert got.tolist() == [1.0] and got.grad_fn is None and not got.requires_grad
