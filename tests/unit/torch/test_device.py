"""The stream/event interface: the fake's deferred execution and ordering, the pinned pool, and
(on a GPU only) the same checks on the CUDA runtime."""

from __future__ import annotations

import torch

from cuda_fakes import cuda_only
from hora.torch import device
from hora.torch.device import CudaRuntime, FakeCudaRuntime, PinnedPool


def test_runtime_is_cuda_exactly_when_torch_sees_a_gpu() -> None:
    rt = device.runtime()
    if torch.cuda.is_available():
        assert isinstance(rt, CudaRuntime) and device.runtime() is rt
    else:
        assert rt is None


def test_fake_copy_runs_only_when_an_event_after_it_is_synchronized() -> None:
    rt = FakeCudaRuntime()
    s = rt.copy_stream(torch.device("cpu"))
    src, dst = torch.arange(4.0), rt.pinned_empty(4, torch.float32)
    dst.zero_()
    rt.copy_async(dst, src, s)
    event = rt.record_event(s)
    assert not rt.event_query(event) and dst.tolist() == [0.0] * 4  # still in flight
    rt.event_synchronize(event)
    assert rt.event_query(event) and dst.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert rt.log[-2:] == [("sync", event.id), ("run", "hora", "d2h")]


def test_fake_stream_wait_orders_work_across_streams() -> None:
    rt = FakeCudaRuntime()
    user, hora = rt.stream("default"), rt.stream("hora")
    t, out = torch.zeros(3), rt.pinned_empty(3, torch.float32)
    rt.enqueue(user, lambda: t.fill_(7.0), "producer")  # the kernel that writes the gradient
    rt.stream_wait_event(hora, rt.record_event(user))
    rt.copy_async(out, t, hora)
    copied = rt.record_event(hora)
    rt.event_synchronize(copied)
    # the copy saw the producer's result because hora's stream waited for the user's event
    assert out.tolist() == [7.0, 7.0, 7.0]
    runs = [e for e in rt.log if e[0] == "run"]
    assert runs == [("run", "default", "producer"), ("run", "hora", "d2h")]


def test_fake_without_the_wait_reads_stale_data() -> None:
    """The counterpart of the test above: the fake really defers, so a missing wait shows."""
    rt = FakeCudaRuntime()
    user, hora = rt.stream("default"), rt.stream("hora")
    t, out = torch.zeros(2), rt.pinned_empty(2, torch.float32)
    rt.enqueue(user, lambda: t.fill_(7.0), "producer")
    rt.copy_async(out, t, hora)
    rt.event_synchronize(rt.record_event(hora))
    assert out.tolist() == [0.0, 0.0]


def test_pool_reuses_a_buffer_only_after_its_last_copy_completed() -> None:
    rt = FakeCudaRuntime()
    pool = PinnedPool(rt, keep=2)
    a = pool.take(8, torch.float32)
    s = rt.stream("hora")
    rt.copy_async(torch.empty(8), a, s)
    pending = rt.record_event(s)
    pool.release(a, pending)
    b = pool.take(8, torch.float32)  # a is still being copied out of: a new buffer
    assert b.data_ptr() != a.data_ptr() and pool.idle() == 1
    rt.event_synchronize(pending)
    assert pool.take(8, torch.float32) is a and pool.idle() == 0
    assert pool.take(8, torch.float64) is not a  # keyed by dtype too
    assert [e for e in rt.log if e[0] == "pinned"] == [("pinned", 8)] * 3


def test_pool_keeps_at_most_keep_idle_buffers_per_size() -> None:
    rt = FakeCudaRuntime()
    pool = PinnedPool(rt, keep=2)
    bufs = [pool.take(4, torch.int32) for _ in range(3)]
    for b in bufs:
        pool.release(b)
    assert pool.idle() == 2


@cuda_only
def test_cuda_runtime_round_trip_through_pinned_memory() -> None:
    rt = CudaRuntime()
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    user, copy = rt.current_stream(dev), rt.copy_stream(dev)
    assert rt.copy_stream(dev) is copy and copy != user
    rt.stream_wait_event(copy, rt.record_event(user))
    host = rt.pinned_empty(src.numel(), src.dtype)
    assert host.is_pinned()
    rt.copy_async(host, src, copy)
    rt.event_synchronize(rt.record_event(copy))
    assert torch.equal(host, src.cpu())
    back = rt.device_empty(src.numel(), src.dtype, dev, user)
    rt.stream_wait_event(copy, rt.record_event(user))
    rt.keep_alive(back, copy)
    rt.copy_async(back, host, copy)
    rt.stream_wait_event(user, rt.record_event(copy))
    assert torch.equal(back * 1, src)  # runs on the user's stream, after its wait
