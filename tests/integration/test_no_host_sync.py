"""No host synchronisation in the steady state of training with NCCL (docs/gpu.md).

A launched rank trains a small model with ``hvd.DistributedOptimizer`` on the job's device
through hora.torch with the NCCL backend (``HOROVOD_GPU_OPERATIONS=NCCL``): a few warm-up steps
(NCCL's communicator, the fusion buffer, the response cache), then the steady-state steps under
one of two checks:

- ``sync_debug``: ``torch.cuda.set_sync_debug_mode("warn")`` with every warning recorded, so a
  synchronising CUDA call in any thread of the process (the caller's, autograd's, the engine's)
  is caught with the line that made it; the mode is process-wide, which suits the NCCL path,
  where nothing should wait on the host (the staged path's event waits are by design and not
  checked here);
- ``profiler``: ``torch.profiler`` with CPU and CUDA activities; no ``cudaDeviceSynchronize``,
  ``cudaStreamSynchronize``, ``cudaEventSynchronize`` or blocking ``cudaMemcpy`` may start
  inside the steady-state steps.

Each check has a control that must trip it (a ``.item()``; a stream synchronize), so that a
check that sees nothing cannot pass. The steps' results must equal plain torch's, and the
gradients must have gone through the engine's NCCL allreduce.

At one rank the DistributedOptimizer reduces nothing (as Horovod's), so the rank hands it a copy
of the global process set whose ``size()`` says two: it then takes its multi-rank path, every
gradient through the engine (``HORA_LOCAL_SETS=0``: a set of one would run them itself) and
NCCL as with more GPUs, while the engine averages over the set's real size (one). NCCL takes
one rank per GPU, so a one-GPU machine runs np=1.

Without a GPU the same steps run on CPU tensors standing in for the GPU's (the NCCL backend class
over Gloo, torch.cuda's streams and hora.torch's stream runtime faked, as in
tests/integration/test_device_buffers.py): no host wait (``event_synchronize``) and no pinned
buffer may appear in the steady state. The GPU checks skip with the reason.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from cuda_fakes import cuda_only
from harness import run_ranks

WARMUP, STEADY = 5, 8
STEP, CONTROL = "hora.steady_step", "hora.control"
# CUDA runtime calls that make the host wait for the device
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")

Event = tuple[str, float, float, int, str, str]  # name, start us, end us, thread, device, parents
# a world of one runs its ops itself (hora.core.solo): these steps go through the engine
THROUGH_ENGINE = {"HORA_LOCAL_SETS": "0"}
# what torch's sync debug mode says of each synchronising call (c10/cuda's warn_or_error_on_sync);
# turning the mode on also warns, once, that it is a prototype that "does not yet detect all
# synchronizing operations": that notice is no synchronisation
SYNC_REPORT = "called a synchronizing CUDA operation"


def sync_reports(messages: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The warnings (index, text) that report a synchronising CUDA call, and no other."""
    return [(i, text) for i, text in messages if SYNC_REPORT in text]


def _fake_gpu(calls: list[str]) -> Any:
    """The fakes (cuda_fakes.fake_gpu_process), the allreduces recording their buffers."""
    from cuda_fakes import fake_gpu_process

    return fake_gpu_process(calls, ("allreduce", "allreduce_parts"))


def _events(prof: Any) -> list[Event]:
    """What the checks need of a profile: annotations and CUDA runtime calls."""
    out = []
    for e in prof.events():
        name = str(e.name)
        if name not in (STEP, CONTROL) and not name.startswith("cuda"):
            continue
        parents, p = [], getattr(e, "cpu_parent", None)
        while p is not None and len(parents) < 4:
            parents.append(str(p.name))
            p = getattr(p, "cpu_parent", None)
        device = getattr(getattr(e, "device_type", None), "name", "CPU")
        out.append((name, float(e.time_range.start), float(e.time_range.end),
                    int(getattr(e, "thread", 0) or 0), device, " < ".join(parents)))  # fmt: skip
    return out


def _steady_state(rank: int, mode: str, check: str) -> dict[str, Any]:
    """Train; run the steady-state steps under ``check``; report what was seen."""
    import copy
    import time
    import warnings
    from collections import Counter

    import torch
    import torch.nn.functional as F  # noqa: N812

    import hora.torch as hvd

    cuda = mode == "cuda"
    calls: list[str] = []
    rt = _fake_gpu(calls) if mode == "fake" else None
    hvd.init()
    from hora.core import runtime as core_runtime
    from hora.torch.adapter import direct_device

    executor = core_runtime.runtime().engine.executor
    dev = direct_device()
    if dev is None or executor.device_ops is None:
        raise AssertionError(
            f"hora chose {type(executor.backend).__name__}, which does not take device tensors: "
            "this check is for the NCCL path (HOROVOD_GPU_OPERATIONS=NCCL)"
        )
    if cuda:
        assert dev.type == "cuda", dev
        torch.cuda.set_device(dev)

    class Activities:  # the executor's timeline: which collectives ran
        def __init__(self) -> None:
            self.seen: Counter[str] = Counter()

        def activity_start(self, name: str, activity: str) -> None:
            self.seen[activity] += 1

        def activity_end(self, name: str) -> None:
            pass

    acts = Activities()
    executor.timeline = acts

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).to(dev)  # fmt: skip
    reference = copy.deepcopy(model)
    n = WARMUP + STEADY
    xs = [torch.randn(32, 64, device=dev) for _ in range(n)]
    ys = [torch.randint(0, 10, (32,), device=dev) for _ in range(n)]
    as_if_two = copy.copy(hvd.global_process_set)
    as_if_two.size = lambda: 2  # type: ignore[method-assign]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), process_set=as_if_two,
    )  # fmt: skip

    def step(m: torch.nn.Module, o: Any, i: int) -> None:
        o.zero_grad()
        F.cross_entropy(m(xs[i]), ys[i]).backward()
        o.step()

    for i in range(WARMUP):
        step(model, opt, i)
    if cuda:
        torch.cuda.synchronize()
    warm_acts = sum(c for a, c in acts.seen.items() if a.endswith("_ALLREDUCE"))
    log_from = len(rt.log) if rt is not None else 0
    calls.clear()
    out: dict[str, Any] = {"device": str(dev), "check": check}

    if check == "sync_debug":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for i in range(WARMUP, n):
                    step(model, opt, i)
                steady = len(caught)
                if cuda:  # the control: a call that synchronises, which the mode must report
                    torch.ones(1, device=dev).item()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        said = sync_reports([(i, f"{w.filename}:{w.lineno}: {w.message}")
                             for i, w in enumerate(caught)])  # fmt: skip
        out["steady_syncs"] = [text for i, text in said if i < steady]
        out["control_syncs"] = [text for i, text in said if i >= steady]
    elif check == "profiler":
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            time.sleep(0.05)  # apart from the profiler's own start
            for i in range(WARMUP, n):
                with record_function(STEP):
                    step(model, opt, i)
            time.sleep(0.05)  # apart from the steps
            with record_function(CONTROL):
                if cuda:  # the control: a host wait the profiler must show
                    torch.cuda.current_stream().synchronize()
            time.sleep(0.05)  # apart from the profiler's own synchronize when it stops
        out["events"] = _events(prof)
    else:
        raise ValueError(check)

    steady_acts = sum(c for a, c in acts.seen.items() if a.endswith("_ALLREDUCE")) - warm_acts
    out["allreduces"] = {"warmup": warm_acts, "steady": steady_acts}
    out["acts"] = sorted(acts.seen)
    out["calls"] = sorted(set(calls))
    if rt is not None:
        out["fake_log"] = [e[0] for e in rt.log[log_from:] if e[0] in ("sync", "pinned")]

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for i in range(n):
        step(reference, ref_opt, i)
    out["max_diff"] = max(
        float((a.detach() - b.detach()).abs().max().cpu())
        for a, b in zip(model.parameters(), reference.parameters())
    )  # fmt: skip
    hvd.shutdown()
    return out


def _base(name: str) -> str:
    """A runtime call's name without CUPTI's version or per-thread suffix."""
    return re.sub(r"(_v\d+|_ptsz|_ptds)$", "", name)


def _span(events: list[Event], label: str) -> tuple[float, float] | None:
    """From the start of the first host-side annotation ``label`` to the end of the last."""
    marks = [e for e in events if e[0] == label and e[4] == "CPU"]
    if not marks:
        return None
    return min(e[1] for e in marks), max(e[2] for e in marks)


def _syncs_between(events: list[Event], start: float, end: float) -> list[Event]:
    return [e for e in events if _base(e[0]) in SYNCS and start <= e[1] <= end]


def _check_common(out: dict[str, Any]) -> None:
    assert out["max_diff"] < 1e-5, f"parameters differ from plain torch's by {out['max_diff']}"
    # every steady-state step's gradients went through the engine's (NCCL's) allreduce
    assert out["allreduces"]["steady"] >= STEADY, out
    assert "NCCL_ALLREDUCE" in out["acts"], out["acts"]


def _check_profile(events: list[Event], cuda: bool, steps: int = STEADY) -> None:
    span = _span(events, STEP)
    assert span is not None, "no steady-state step annotation in the profile"
    assert len([e for e in events if e[0] == STEP and e[4] == "CPU"]) == steps
    bad = _syncs_between(events, *span)
    assert not bad, "host synchronisation in the steady state:\n" + "\n".join(
        f"  {e[0]} (thread {e[3]}, under {e[5] or '?'})" for e in bad
    )
    if not cuda:
        return
    runtime = [e for e in events if e[0].startswith("cuda") and span[0] <= e[1] <= span[1]]
    names = sorted({_base(e[0]) for e in events if e[0].startswith("cuda")})
    assert runtime, f"no CUDA runtime call inside the steps: the check sees nothing ({names})"
    control = [e for e in events if _base(e[0]) == "cudaStreamSynchronize" and e[1] > span[1]]
    assert control, (
        "the control's stream synchronize is not in the profile, so the check would prove "
        f"nothing; runtime calls seen: {names}"
    )


def test_the_profile_check_finds_synchronisations_in_the_steps_only() -> None:
    """The analysis, on a made-up profile: a synchronize inside the steps is found with where
    it came from; the profiler's own (before and after) and other calls are not."""
    events: list[Event] = [
        ("cudaDeviceSynchronize", 1.0, 2.0, 1, "CPU", ""),  # the profiler's start
        (STEP, 10.0, 20.0, 1, "CPU", ""),
        (STEP, 10.5, 19.0, 0, "CUDA", ""),  # the device's copy of the annotation
        ("cudaLaunchKernel", 11.0, 11.5, 1, "CPU", "aten::mm"),
        ("cudaMemcpyAsync", 12.0, 12.5, 7, "CPU", "aten::copy_"),
        (STEP, 21.0, 30.0, 1, "CPU", ""),
        ("cudaStreamSynchronize_v3020", 30.0, 30.5, 1, "CPU", "aten::_local_scalar_dense"),
        (CONTROL, 40.0, 42.0, 1, "CPU", ""),
        ("cudaStreamSynchronize", 41.0, 41.5, 1, "CPU", ""),
        ("cudaDeviceSynchronize", 50.0, 51.0, 1, "CPU", ""),  # the profiler's stop
    ]
    assert _span(events, STEP) == (10.0, 30.0)
    assert [e[0] for e in _syncs_between(events, 10.0, 30.0)] == ["cudaStreamSynchronize_v3020"]
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        _check_profile(events, cuda=True, steps=2)
    _check_profile([e for e in events if e[1] != 30.0], cuda=True, steps=2)
    with pytest.raises(AssertionError, match="control"):
        _check_profile([e for e in events if e[1] not in (30.0, 41.0)], cuda=True, steps=2)


def test_only_reports_of_synchronising_calls_count() -> None:
    """torch's notice that the sync debug mode is a prototype is not a synchronisation; the
    report of a synchronising call is, wherever it came from."""
    caught = [
        (0, "torch/cuda/__init__.py:1: UserWarning: Synchronization debug mode is a prototype "
            "feature and does not yet detect all synchronizing operations"),
        (1, "optim.py:9: UserWarning: some other warning"),
        (2, "x.py:3: UserWarning: called a synchronizing CUDA operation (Triggered internally "
            "at c10/cuda/CUDAFunctions.cpp:151.)"),
    ]  # fmt: skip
    assert sync_reports(caught) == [caught[2]]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("check", ["sync_debug", "profiler"])
def test_steady_state_training_on_the_fake_gpu_waits_on_no_host(check: str) -> None:
    (out,) = run_ranks(_steady_state, 1, args=("fake", check), timeout=120, env=THROUGH_ENGINE)
    _check_common(out)
    assert out["fake_log"] == [], out["fake_log"]  # no host wait, no pinned buffer
    assert out["calls"] and all(c.endswith(":tensor") for c in out["calls"]), out["calls"]
    if check == "profiler":
        _check_profile(out["events"], cuda=False)
    else:
        assert out["steady_syncs"] == []


NCCL_ENV = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HORA_LOG_LEVEL": "WARNING", **THROUGH_ENGINE}


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(200)
def test_no_synchronising_cuda_call_in_steady_state_training_on_a_gpu() -> None:
    (out,) = run_ranks(_steady_state, 1, args=("cuda", "sync_debug"), timeout=150, env=NCCL_ENV)
    assert out["device"].startswith("cuda"), out["device"]
    _check_common(out)
    assert out["steady_syncs"] == [], "synchronising CUDA calls in the steady state:\n" + \
        "\n".join(out["steady_syncs"])  # fmt: skip
    assert out["control_syncs"], "the control's .item() was not reported: the check sees nothing"


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(200)
def test_the_profiler_shows_no_host_synchronisation_in_steady_state_training_on_a_gpu() -> None:
    (out,) = run_ranks(_steady_state, 1, args=("cuda", "profiler"), timeout=150, env=NCCL_ENV)
    assert out["device"].startswith("cuda"), out["device"]
    _check_common(out)
    _check_profile(out["events"], cuda=True)
