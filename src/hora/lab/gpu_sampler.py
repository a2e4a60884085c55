"""GPU utilisation and memory, sampled while a benchmark configuration runs.

:class:`GpuSampler` polls this host's GPUs in a daemon thread: through NVML (``pynvml``) every
50 ms when it can be imported and initialised, else through
``nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits``
every 0.2 s (each call with a timeout; a call takes tens of milliseconds). A training step on a
GPU can last 40 ms, and a short run's timed steps well under a second: sampled every half
second, such a run gave its mean from one or two readings, or from the idle start-up, so the
figure meant nothing. The summary says how many samples it rests on (``gpu_samples``), and the
tables show it. Without either it stays idle and :meth:`GpuSampler.stop` returns
None, so the callers add no GPU columns. ``indices`` restricts the summary to the GPUs a
configuration uses (nvidia-smi's numbering); ``timed`` says whether the timed part of the run
has begun: when it gives samples, only those count (start-up and warm-up leave the GPU idle and
would lower the mean), otherwise every sample does.

The summary (:meth:`GpuSampler.stop`): ``gpu_util_mean_pct`` (the mean over samples of the
used GPUs' mean utilisation), ``gpu_util_max_pct`` (the highest one GPU reached),
``gpu_mem_max_mib`` (the most memory one GPU held), ``gpu_samples``, ``gpu_sampled`` ("timed
steps" or "whole run") and ``gpu_source``.

``start``/``stop`` are called from one thread (the benchmark's); the polling thread only appends
samples under a lock, so :meth:`GpuSampler.count` may be called from anywhere.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import statistics
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

QUERY = [
    "nvidia-smi",
    "--query-gpu=index,utilization.gpu,memory.used",
    "--format=csv,noheader,nounits",
]
SOURCES = ("auto", "nvml", "nvidia-smi")
# seconds between readings, by source (NVML is a library call; nvidia-smi a process each time)
INTERVALS = {"nvml": 0.05, "nvidia-smi": 0.2}
# fewer timed samples than this and the tables say the figure rests on too few
MIN_SAMPLES = 10


@dataclass(frozen=True)
class Sample:
    timed: bool  # taken once the timed part had begun
    gpus: dict[int, tuple[float, float]]  # nvidia-smi index -> (utilisation %, MiB used)


def parse_query(text: str) -> dict[int, tuple[float, float]]:
    """``"0, 87, 1234"`` lines -> ``{0: (87.0, 1234.0)}``; lines with ``[N/A]``, ``[Not
    Supported]`` or too few fields are left out."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 3:
            continue
        try:
            out[int(cells[0])] = (float(cells[1]), float(cells[2]))
        except ValueError:
            continue
    return out


class _Smi:
    name = "nvidia-smi"

    def read(self) -> dict[int, tuple[float, float]]:
        try:
            done = subprocess.run(QUERY, capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return parse_query(done.stdout) if done.returncode == 0 else {}

    def close(self) -> None:
        pass


class _Nvml:
    name = "nvml"

    def __init__(self) -> None:
        self.nvml: Any = importlib.import_module("pynvml")
        self.nvml.nvmlInit()
        count = self.nvml.nvmlDeviceGetCount()
        self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def read(self) -> dict[int, tuple[float, float]]:
        out = {}
        for i, handle in enumerate(self.handles):
            with contextlib.suppress(Exception):  # pynvml.NVMLError: that GPU has no reading
                util = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                used = self.nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                out[i] = (float(util), float(used))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def _open(source: str) -> _Smi | _Nvml | None:
    if source not in SOURCES:
        raise ValueError(f"GPU sampler source {source!r}: choose from {', '.join(SOURCES)}")
    if source in ("auto", "nvml") and importlib.util.find_spec("pynvml") is not None:
        with contextlib.suppress(Exception):  # no driver, no GPU: NVMLError
            return _Nvml()
    if source in ("auto", "nvidia-smi") and shutil.which("nvidia-smi"):
        return _Smi()
    return None


class GpuSampler:
    """Samples GPU utilisation and memory between :meth:`start` and :meth:`stop` (or as a
    context manager, the summary then in :attr:`summary`)."""

    def __init__(
        self,
        indices: Sequence[int] | None = None,
        interval: float | None = None,
        timed: Callable[[], bool] | None = None,
        source: str = "auto",
    ) -> None:
        """``interval``: seconds between readings; None: the source's (:data:`INTERVALS`)."""
        if interval is not None and interval <= 0:
            raise ValueError(f"sampling interval must be positive seconds, got {interval}")
        self.indices = None if indices is None else list(indices)
        self.interval, self.timed, self.source = interval, timed, source
        self.summary: dict[str, Any] | None = None
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: _Smi | _Nvml | None = None

    def start(self) -> GpuSampler:
        self._reader = _open(self.source)
        if self._reader is not None:
            self._thread = threading.Thread(
                target=self._run, args=(self._reader,), name="gpu-sampler", daemon=True
            )
            self._thread.start()
        return self

    def _run(self, reader: _Smi | _Nvml) -> None:
        interval = self.interval or INTERVALS[reader.name]
        while True:
            timed = self.timed() if self.timed is not None else True  # before the reading
            gpus = reader.read()
            if self.indices is not None:
                gpus = {i: v for i, v in gpus.items() if i in self.indices}
            if gpus:
                with self._lock:
                    self._samples.append(Sample(timed, gpus))
            if self._stop.wait(interval):
                return

    def count(self) -> int:
        """Samples taken so far."""
        with self._lock:
            return len(self._samples)

    def stop(self) -> dict[str, Any] | None:
        """End sampling; the summary (see the module docstring), None without samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._reader is not None:
            self._reader.close()
        with self._lock:
            samples = list(self._samples)
        self.summary = summarize(samples, self._reader.name if self._reader else "none")
        return self.summary

    def __enter__(self) -> GpuSampler:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def summarize(samples: Sequence[Sample], source: str) -> dict[str, Any] | None:
    """The summary of ``samples`` (the timed ones when there are any), None when empty."""
    timed = [s for s in samples if s.timed]
    chosen = timed or list(samples)
    if not chosen:
        return None
    utils = [u for s in chosen for u, _ in s.gpus.values()]
    return {
        "gpu_util_mean_pct": statistics.fmean(
            statistics.fmean(u for u, _ in s.gpus.values()) for s in chosen
        ),
        "gpu_util_max_pct": max(utils),
        "gpu_mem_max_mib": max(m for s in chosen for _, m in s.gpus.values()),
        "gpu_samples": len(chosen),
        "gpu_sampled": "timed steps" if timed else "whole run",
        "gpu_source": source,
    }
