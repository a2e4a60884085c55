"""CUDA tensors staged through pinned memory: the order of stream operations (on the fake
runtime, which defers stream work until an event is awaited), the pinned pool, and CPU
tensors untouched. The last tests repeat the round trip on a real GPU where there is one."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cuda_fakes import cuda_only
from hora.torch import adapter
from hora.torch.adapter import stage, stage_device, to_device, to_tensor, write_back
from hora.torch.device import FakeCudaRuntime


@pytest.fixture(autouse=True)
def no_device_wide_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any call to torch.cuda.synchronize() fails the test: hora waits on events only."""

    def forbidden(*args: object) -> None:
        raise AssertionError("torch.cuda.synchronize() called: hora must wait on events only")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    yield


def ops(rt: FakeCudaRuntime, since: int = 0) -> list[tuple[object, ...]]:
    """The log without event ids (they are counters), from ``since`` on."""
    return [(e[0], e[1]) if e[0] in ("record", "wait") else e for e in rt.log[since:]]


def test_stage_orders_the_copy_after_the_callers_work_and_waits_on_one_event() -> None:
    rt = FakeCudaRuntime()
    grad = torch.zeros(2, 3)
    rt.enqueue(rt.stream("default"), lambda: grad.fill_(5.0), "backward")  # still in flight
    s = stage_device(grad, rt, defer=True)
    assert s.copied and s.array.shape == (2, 3) and s.dtype is None
    assert ops(rt) == [
        ("record", "default"),  # an event on the caller's stream...
        ("wait", "hora"),  # ...that hora's copy stream waits on
        ("pinned", 6),
        ("keep_alive", "hora"),
        ("copy", "hora", "d2h"),  # into pinned memory, on hora's stream
        ("record", "hora"),  # the "copied" event
    ]
    wait_id, copied_id = rt.log[1][2], rt.log[5][2]
    assert wait_id == rt.log[0][2] and s.event.id == copied_id
    assert not np.any(s.array)  # nothing ran yet: the copy is asynchronous
    s.ready()  # what the engine does before it first reads the array
    assert rt.log[6] == ("sync", copied_id)  # the host waited on that event only
    np.testing.assert_array_equal(s.array, np.full((2, 3), 5.0, dtype=np.float32))
    assert [e for e in rt.log if e[0] == "run"] == [
        ("run", "default", "backward"), ("run", "hora", "d2h")
    ]  # fmt: skip
    s.ready()  # again: no new work, nothing breaks
    np.testing.assert_array_equal(s.array, np.full((2, 3), 5.0, dtype=np.float32))


def test_stage_waits_before_returning_unless_deferred() -> None:
    rt = FakeCudaRuntime()
    t = torch.arange(4.0)
    s = stage_device(t, rt)
    assert ("sync", s.event.id) in rt.log and s.array.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_in_place_write_back_copies_on_horas_stream_and_the_caller_waits_on_the_device() -> None:
    rt = FakeCudaRuntime()
    user = rt.stream("default")
    t = torch.arange(4.0)
    s = stage_device(t, rt)
    np.multiply(s.array, 10, out=s.array)  # the engine reduces in place, in pinned memory
    since = len(rt.log)
    assert write_back(s, s.array) is t
    assert ops(rt, since) == [
        ("record", "default"),
        ("wait", "hora"),
        ("keep_alive", "hora"),
        ("copy", "hora", "h2d"),  # straight from the pinned buffer the engine wrote
        ("record", "hora"),
        ("wait", "default"),  # the caller's stream waits for the copy; the host does not
    ]
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]  # still in flight
    seen: list[float] = []
    rt.enqueue(user, lambda: seen.extend(t.tolist()), "optimizer step")  # the user's next kernel
    rt.event_synchronize(rt.record_event(user))
    assert seen == [0.0, 10.0, 20.0, 30.0] and t.tolist() == seen


def test_result_from_another_array_is_copied_through_a_pooled_pinned_buffer() -> None:
    rt = FakeCudaRuntime()
    t = torch.ones(3, dtype=torch.int32)
    s = stage_device(t, rt)
    write_back(s, np.array([4, 5, 6], dtype=np.int32))
    rt.event_synchronize(rt.record_event(rt.stream("default")))
    assert t.tolist() == [4, 5, 6]
    assert adapter.pool(rt).idle() == 1  # the extra pinned buffer went back to the pool


def test_pinned_buffer_goes_back_when_dropped_and_is_reused_after_its_last_copy() -> None:
    rt = FakeCudaRuntime()
    t = torch.zeros(5)
    s = stage_device(t, rt)
    buf = s.lease.buf if s.lease else None
    write_back(s, s.array)  # h2d out of the pinned buffer, not yet run
    del s
    gc.collect()
    p = adapter.pool(rt)
    assert p.idle() == 1
    assert p.take(5, torch.float32) is not buf  # its h2d copy is still pending
    rt.event_synchronize(rt.record_event(rt.stream("default")))
    assert p.take(5, torch.float32) is buf


def test_to_device_waits_on_the_stream_current_when_the_tensor_was_staged() -> None:
    rt = FakeCudaRuntime()
    side = rt.stream("side")
    rt.set_current(side)  # the user thread works on its own stream
    like = torch.zeros(2, 2, dtype=torch.float64)
    stage_device(like, rt)
    out: list[torch.Tensor] = []
    engine = threading.Thread(  # finalizers run in the engine thread, whose stream is default
        target=lambda: out.append(to_device(np.arange(4.0).reshape(2, 2), like, rt))
    )
    engine.start()
    engine.join(timeout=30)
    assert not engine.is_alive()
    result = out[0]
    assert result.shape == (2, 2) and result.dtype == torch.float64
    tail = ops(rt)[-6:]
    assert tail[0] == ("record", "side")
    assert rt.log.count(("pinned", 4)) == 1  # the staged tensor's buffer, reused: it was dropped
    assert tail[-1] == ("wait", "side") and ("copy", "hora", "h2d") in tail
    rt.event_synchronize(rt.record_event(side))
    assert result.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_bfloat16_and_non_contiguous_device_tensors() -> None:
    rt = FakeCudaRuntime()
    base = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    t = base.t()  # non-contiguous
    s = stage_device(t, rt)
    assert s.dtype == "bfloat16" and s.array.dtype == np.uint16 and s.array.shape == (3, 2)
    doubled = (torch.from_numpy(s.array.view(np.int16)).view(torch.bfloat16) * 2).contiguous()
    write_back(s, doubled.view(torch.int16).numpy().view(np.uint16))
    rt.event_synchronize(rt.record_event(rt.stream("default")))
    assert torch.equal(base, torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * 2)


def test_cpu_tensors_stay_zero_copy_views() -> None:
    rt = FakeCudaRuntime()
    t = torch.arange(3.0)
    s = stage(t, runtime=rt)
    assert not s.copied and s.runtime is None and s.array.ctypes.data == t.data_ptr()
    s.ready()
    assert rt.log == [] and to_tensor(s.array, t, runtime=rt).data_ptr() == t.data_ptr()


@cuda_only
def test_cuda_tensor_round_trip_in_place_and_new() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.arange(1000, dtype=torch.float32, device=dev)
    s = stage(t)
    assert s.runtime is not None and s.lease is not None and s.lease.buf.is_pinned()
    np.multiply(s.array, 2, out=s.array)
    assert write_back(s, s.array) is t
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32, device=dev) * 2)
    out = to_tensor(np.ones((10, 100), dtype=np.float32), t)
    assert out.device == dev and out.shape == (10, 100) and bool((out == 1).all())


@cuda_only
def test_cuda_staging_from_a_side_stream() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        t = torch.full((1 << 20,), 3.0, device=dev)
        t.mul_(2)  # queued on the side stream, maybe not run yet
        s = stage(t)
    assert float(s.array[-1]) == 6.0
    np.add(s.array, 1, out=s.array)
    write_back(s, s.array)
    with torch.cuda.stream(side):
        assert bool((t == 7.0).all())
