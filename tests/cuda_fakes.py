"""Fakes that stand in for a GPU in tests on machines without one (named as fakes wherever
they are used): torch.cuda's streams and events, and an NcclBackend whose "GPU" is the CPU and
whose groups are Gloo's. Shared by the backend unit tests and the integration tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from hora.backends.gloo import GlooBackend
from hora.backends.nccl import NcclBackend
from hora.backends.registry import BackendContext
from hora.torch.device import FakeCudaRuntime

# the real-GPU twins of the tests that run on these fakes skip, saying why, where there is none
GPU = torch.cuda.is_available()
NO_GPU = "needs a CUDA GPU: torch.cuda.is_available() is False here (run scripts/gpu_verify.sh)"
cuda_only = pytest.mark.skipif(not GPU, reason=NO_GPU)


class FakeStreams:
    """A fake of torch.cuda's streams and events: logs (thread's name, what, stream)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.current = threading.local()

    def who(self) -> str:
        return threading.current_thread().name

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream(self.log, getattr(self.current, "stream", "caller"))

    def Event(self) -> Any:  # noqa: N802 - torch.cuda.Event's name
        fake = self

        class Ev:
            def record(self, stream: FakeStream) -> None:
                fake.log.append((fake.who(), "record", stream.name))

        return Ev()

    @contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        before = self.current_stream().name
        self.current.stream = s.name
        self.log.append((self.who(), "enter", s.name))
        try:
            yield
        finally:
            self.current.stream = before
            self.log.append((self.who(), "exit", s.name))

    def install(self, setattr_: Any = setattr) -> None:
        """Put this fake in torch.cuda's place (``setattr_``: a monkeypatch's, in a test)."""
        setattr_(torch.cuda, "current_stream", self.current_stream)
        setattr_(torch.cuda, "Event", self.Event)
        setattr_(torch.cuda, "stream", self.stream)


class FakeCudaOnlyRuntime(FakeCudaRuntime):
    """A fake of hora's CUDA runtime as it meets a tensor that is not a CUDA one: it has no
    streams for it, and ``current_stream`` of such a device raises ValueError, as
    ``torch.cuda.current_stream(torch.device("cpu"))`` does on a GPU machine."""

    def serves(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return super().current_stream(device)


class FakeStream:
    def __init__(self, log: list[tuple[str, str, str]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: Any) -> None:
        self.log.append((threading.current_thread().name, "wait", self.name))


def nccl_on_cpu(ctx: BackendContext, fake: FakeStreams) -> NcclBackend:
    """An NcclBackend whose "GPU" is the CPU and whose groups are Gloo's (no GPU here); what
    its ``__init__`` reads of the settings, it reads here too."""
    b = object.__new__(NcclBackend)
    GlooBackend.__init__(b, ctx)
    b._device = torch.device("cpu")
    b._stream = FakeStream(fake.log, "hora")  # type: ignore[assignment]
    b.last_done = None
    b._hierarchical = NcclBackend.wants_two_level(ctx.settings)
    b._make_group = lambda *a: GlooBackend._make_group(b, *a)  # type: ignore[method-assign]
    return b


def fake_gpu_process(calls: list[str], ops: tuple[str, ...]) -> Any:
    """Patch this (launched rank's) process to run on the fakes: torch.cuda's streams faked,
    the engine's backend an NcclBackend over Gloo on the CPU whose ``ops`` record in ``calls``
    the kind of buffer each gets (``"allreduce:tensor"``, ``"allreduce:host"``), hora.torch's
    stream runtime a FakeCudaRuntime (returned)."""
    import numpy as np

    import hora.backends.registry as registry
    from hora.torch import device
    from hora.torch.device import FakeCudaRuntime

    fake = FakeStreams()
    fake.install()

    def make(name: str, ctx: Any) -> NcclBackend:
        b = nccl_on_cpu(ctx, fake)
        for op in ops:
            real = getattr(b, op, None)
            if real is None:
                continue

            def recording(comm: Any, buf: Any, *rest: Any, _op: str = op, _real: Any = real
                          ) -> Any:  # fmt: skip
                kinds = buf if isinstance(buf, list) else [buf]
                calls.extend(f"{_op}:{'host' if isinstance(k, np.ndarray) else 'tensor'}"
                             for k in kinds)  # fmt: skip
                return _real(comm, buf, *rest)

            setattr(b, op, recording)
        return b

    registry.create = make  # type: ignore[assignment]
    rt = FakeCudaRuntime()
    device.runtime = lambda: rt  # type: ignore[assignment]
    return rt
