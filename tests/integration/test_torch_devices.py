"""``backend="hora"`` and CUDA tensors: which backend each device type's tensors reach.

* torch's per-device form on real ranks (np=2): ``"cpu:gloo,cuda:hora"`` sends CPU tensors to
  Gloo and none to hora; ``"cpu:hora,cuda:gloo"`` the other way; ``"hora"`` and
  ``"cuda:hora"`` everything to hora. Results match in each case.
* A DDP job on ``backend="hora"`` whose "GPU" is the CPU (the named fakes of
  tests/cuda_fakes.py: torch.cuda's streams faked, hora's backend an NcclBackend over Gloo):
  every gradient reaches hora's NCCL backend as the tensor itself, never a host copy, and the
  losses are Gloo's in the same processes.
* On a machine with a GPU, hora serving CUDA tensors starts with NCCL unless a backend is
  named (checked here with ``torch.cuda.is_available`` patched); the real-GPU DDP job skips
  elsewhere, saying why.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from cuda_fakes import cuda_only, fake_gpu_process
from harness import run_ranks
from hora.lab.procs import free_port


# -- per-device backends on real ranks ------------------------------------------------------
def routed(rank: int, spec: str) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401
    from hora.torch.distributed import group

    torch.set_num_threads(1)
    seen: list[str] = []
    for name in ("allreduce", "broadcast", "send", "recv"):
        real = getattr(group.HoraProcessGroup, name)

        def counting(self: Any, *a: Any, _real: Any = real, _name: str = name) -> Any:
            seen.append(_name)
            return _real(self, *a)

        setattr(group.HoraProcessGroup, name, counting)
    dist.init_process_group(spec)
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=1)
    m = torch.full((2,), 7.0) if rank == 0 else torch.zeros(2)
    if rank == 0:
        dist.send(m, 1)
    else:
        dist.recv(m, 0)
    out = {"values": [t.tolist(), b.tolist(), m.tolist()], "hora_calls": sorted(set(seen)),
           "backend": dist.get_backend()}  # fmt: skip
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spec,on_hora", [("cpu:gloo,cuda:hora", False),
                                          ("cpu:hora,cuda:gloo", True),
                                          ("cuda:hora", True), ("hora", True)])  # fmt: skip
def test_each_device_type_goes_to_its_backend(spec: str, on_hora: bool) -> None:
    outs = run_ranks(routed, 2, args=(spec,), timeout=150)
    for rank, out in enumerate(outs):
        assert out["values"] == [[3.0] * 3, [1.0, 1.0], [7.0, 7.0]], out
        assert out["backend"] == spec
        want = ["allreduce", "broadcast", "recv" if rank else "send"] if on_hora else []
        assert out["hora_calls"] == want, (spec, out["hora_calls"])


# -- a DDP job on hora's NCCL backend (fakes) -----------------------------------------------
def _train(rank: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ddp = DDP(model, bucket_cap_mb=0.0005)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ddp(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses + [float(p.sum()) for p in model.parameters()]


def ddp_on_fake_gpu(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch as hvd
    import hora.torch.distributed  # noqa: F401
    from hora.core import runtime as core_runtime

    torch.set_num_threads(1)
    calls: list[str] = []
    fake_gpu_process(calls, ("allreduce", "broadcast", "allgatherv"))  # the named fakes
    fake_event = torch.cuda.Event

    class FakeEvent:  # a type, as torch's is: torch's futures test values against it
        def __new__(cls, *args: Any, **kw: Any) -> Any:
            return fake_event()

    torch.cuda.Event = FakeEvent  # type: ignore[assignment,misc]
    dist.init_process_group("hora")
    direct = core_runtime.runtime().engine.executor.device_ops is not None
    hora_losses = _train(rank)
    port = hvd.broadcast_object(free_port() if rank == 0 else None, 0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    gloo_losses = _train(rank)
    dist.destroy_process_group()
    return {"direct": direct, "calls": sorted(set(calls)), "hora": hora_losses,
            "gloo": gloo_losses}  # fmt: skip


@pytest.mark.timeout(200)
def test_ddp_on_hora_gives_its_nccl_backend_the_tensors_where_they_lie() -> None:
    for out in run_ranks(ddp_on_fake_gpu, 2, timeout=150):
        assert out["direct"], "the engine does not take device buffers"
        assert "allreduce:tensor" in out["calls"] and "allreduce:host" not in out["calls"], out
        torch.testing.assert_close(out["hora"], out["gloo"], atol=1e-5, rtol=1e-5)


# -- which hora backend a GPU job starts ----------------------------------------------------
@pytest.mark.parametrize("served,env,chosen", [
    ({"cpu", "cuda"}, {}, True),
    ({"cuda"}, {}, True),
    ({"cpu"}, {}, False),  # "cpu:hora,cuda:nccl": CUDA tensors are NCCL's own
    ({"cpu", "cuda"}, {"HOROVOD_CPU_OPERATIONS": "gloo"}, False),
    ({"cpu", "cuda"}, {"HORA_GPU_OPERATIONS": "MPI"}, False),
])  # fmt: skip
def test_a_gpu_job_serving_cuda_tensors_starts_hora_with_nccl(
    monkeypatch: pytest.MonkeyPatch, served: set[str], env: dict[str, str], chosen: bool
) -> None:
    from hora.torch.distributed.devices import choose_gpu_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU
    environ = dict(env)
    assert choose_gpu_backend(served, environ) is chosen
    assert (environ.get("HOROVOD_GPU_OPERATIONS") == "NCCL") is chosen
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_gpu_backend(served, {}) is False  # no GPU: hora's own backend


def ddp_on_gpu(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401
    from hora.core import runtime as core_runtime

    dist.init_process_group("hora")
    torch.cuda.set_device(int(os.environ.get("HORA_LOCAL_RANK", "0")))
    model = torch.nn.Linear(8, 2).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(4, 8, device="cuda")).sum().backward()
    out = {"backend": core_runtime.runtime().backend_name,
           "grad_device": str(model.weight.grad.device)}  # fmt: skip
    dist.destroy_process_group()
    return out


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(200)
def test_ddp_on_a_gpu_runs_on_hora_nccl() -> None:
    (out,) = run_ranks(ddp_on_gpu, 1, timeout=150, env={"HORA_LOCAL_SETS": "0"})
    assert out["backend"] == "nccl" and out["grad_device"].startswith("cuda"), out
