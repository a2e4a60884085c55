"""CUDA tensors through hora.torch: staged through host memory, results back on the GPU.

Needs an NVIDIA GPU (two ranks share it); skipped elsewhere with the reason.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def cuda_ops(rank: int) -> str:
    import hora.torch as hvd

    hvd.init()
    n = hvd.size()
    x = torch.full((3, 2), float(rank + 1), device="cuda", requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, name="cuda.ar")
    assert y.device.type == "cuda"
    assert torch.equal(y.cpu(), torch.full((3, 2), float(n * (n + 1) // 2)))
    y.sum().backward()
    assert x.grad.device.type == "cuda" and torch.equal(x.grad.cpu(), torch.full((3, 2), float(n)))
    t = torch.full((4,), float(rank), device="cuda", dtype=torch.bfloat16)
    assert hvd.broadcast_(t, n - 1, name="cuda.bc") is t
    assert t.device.type == "cuda" and t.float().cpu().tolist() == [float(n - 1)] * 4
    g = hvd.allgather(torch.full((rank + 1, 2), float(rank), device="cuda"), name="cuda.ag")
    assert g.device.type == "cuda" and g.shape == (n * (n + 1) // 2, 2)
    model = torch.nn.Linear(4, 2).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model(torch.full((2, 4), float(rank), device="cuda")).sum().backward()
    opt.step()
    weights = hvd.allgather_object(model.weight.detach().cpu())
    assert all(torch.equal(w, weights[0]) for w in weights)
    hvd.shutdown()
    return "ok"


@pytest.mark.timeout(200)
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    assert run_ranks(cuda_ops, 2, timeout=150) == ["ok", "ok"]
