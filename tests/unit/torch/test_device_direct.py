"""Tensors handed to the engine as they are (a backend that takes device buffers, NCCL): no
staging, and the streams ordered by events only, on the fake runtime."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from cuda_fakes import FakeCudaOnlyRuntime, cuda_only
from hora.core.buffers import DeviceArray
from hora.frameworks.submit import _array
from hora.torch import adapter
from hora.torch.adapter import direct_device, stage, stage_direct, to_tensor, write_back
from hora.torch.device import FakeCudaRuntime


def ops(rt: FakeCudaRuntime, since: int = 0) -> list[tuple[object, ...]]:
    return [(e[0], e[1]) if e[0] in ("record", "wait") else e for e in rt.log[since:]]


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in another thread (the engine's), whose current stream is the default one."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0]


def test_a_direct_tensor_is_its_own_memory_and_the_engines_stream_waits_for_the_caller() -> None:
    rt = FakeCudaRuntime()
    rt.set_current(rt.stream("side"))  # the caller works on a side stream
    t = torch.arange(4.0)
    s = stage_direct(t, rt)
    assert s.direct and not s.copied and s.dtype is None
    assert isinstance(s.array, DeviceArray) and s.array.dtype == "float32"
    assert s.array.data.data_ptr() == t.data_ptr()  # no copy
    assert ops(rt) == [("record", "side")]  # the caller's work so far; the host goes on
    in_thread(s.ready)  # what the engine does before it first touches the tensor
    assert ops(rt, 1) == [("wait", "default")]  # the engine thread's stream waits on it
    assert rt.log[1][2] == rt.log[0][2]
    assert not any(e[0] in ("sync", "pinned", "copy") for e in rt.log)


def test_results_are_handed_to_the_callers_stream_by_an_event() -> None:
    rt = FakeCudaRuntime()
    rt.set_current(rt.stream("side"))
    t = torch.arange(3.0)
    s = stage_direct(t, rt)
    since = len(rt.log)
    new = torch.ones(3)
    assert in_thread(lambda: to_tensor(new, t, rt)) is new  # a new tensor, as it is
    assert ops(rt, since) == [("record", "default"), ("wait", "side"),
                              ("keep_alive", "side")]  # fmt: skip
    since = len(rt.log)
    assert in_thread(lambda: write_back(s, s.array.data)) is t  # in place: the engine wrote t
    assert ops(rt, since) == [("record", "default"), ("wait", "side")]
    assert not any(e[0] in ("sync", "pinned", "copy") for e in rt.log)


def test_the_same_stream_needs_no_event_and_a_cpu_stand_in_no_runtime() -> None:
    rt = FakeCudaRuntime()
    t = torch.arange(3.0)
    s = stage_direct(t, rt)  # the caller on the default stream, as the engine
    since = len(rt.log)
    in_thread(lambda: write_back(s, s.array.data))
    assert rt.log[since:] == []
    plain = stage_direct(t, None)
    plain.ready()
    assert plain.event is None and write_back(plain, plain.array.data) is t


def test_a_non_contiguous_tensor_is_copied_and_its_result_written_back() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    s = stage_direct(t, None)
    assert s.copied and s.array.data.is_contiguous() and s.array.data.shape == (3, 2)
    result = torch.full((3, 2), 7.0)
    assert write_back(s, result) is t and t.tolist() == [[7.0, 7.0]] * 3


def test_stage_hands_over_tensors_of_the_jobs_device_only(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:  # fmt: skip
    assert direct_device() is None  # not initialized: no backend, nothing direct
    t = torch.arange(2, dtype=torch.bfloat16)
    assert not stage(t).direct and isinstance(stage(t).array, np.ndarray)
    monkeypatch.setattr(adapter, "direct_device", lambda: torch.device("cpu"))
    s = stage(t)
    assert s.direct and isinstance(s.array, DeviceArray) and s.array.dtype == "bfloat16"
    data, name, user = _array(s.array, None)  # what the op surface makes of it
    assert data is s.array.data and name == "bfloat16" and user == torch.bfloat16
    monkeypatch.setattr(adapter, "direct_device", lambda: torch.device("meta"))
    assert not stage(t).direct  # a tensor elsewhere is staged as before


def test_a_direct_cpu_tensor_takes_no_cuda_stream_where_the_runtime_is_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The job's direct device is the CPU (the NCCL backend's stand-in on CPU) while the
    process has the CUDA runtime (a GPU machine): a CPU tensor has no stream to record on, so
    it is handed over without one, and handed back without one (the CUDA runtime faked as it
    treats a CPU device: cuda_fakes.FakeCudaOnlyRuntime)."""
    fake = FakeCudaOnlyRuntime()
    monkeypatch.setattr(adapter._device, "runtime", lambda: fake)
    monkeypatch.setattr(adapter, "direct_device", lambda: torch.device("cpu"))
    t = torch.arange(4.0)
    s = stage(t)
    assert s.direct and s.runtime is None and s.event is None and s.stream is None
    s.ready()
    assert write_back(s, s.array.data) is t
    new = torch.ones(4)
    assert to_tensor(new, t) is new
    assert fake.log == []  # no stream, event or copy was asked of the CUDA runtime




@cuda_only
def test_a_cuda_tensor_direct_and_back_on_a_side_stream() -> None:
    from hora.torch import device

    rt = device.runtime()
    assert rt is not None
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 2
        s = stage_direct(t, rt)
    assert s.array.data.data_ptr() == t.data_ptr() and s.stream == side

    def engine() -> torch.Tensor:
        s.ready()  # the engine thread's stream waits for the side stream's work
        return to_tensor(s.array.data + 1, t, rt)  # a result made on the engine's stream

    out = in_thread(engine)
    with torch.cuda.stream(side):
        got = out.sum().item()  # the side stream waits for the hand-back event
    assert got == float(sum(range(1 << 20)) * 2 + (1 << 20))
