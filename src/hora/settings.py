"""Every knob hora has, declared once.

Each :class:`Knob` names its field, type, default, environment variables (``HORA_*`` first,
Horovod's ``HOROVOD_*`` accepted beside it), the ``hora run`` flag that sets it and the section of
a Horovod YAML config file it lives in. :func:`load` builds one typed :class:`Settings` from the
environment; the launcher exports a Settings back into the workers' environment with
:func:`to_env`. Tests check that the CLI, this table and the docs name the same knobs.

Pure data, no threads; safe to import from anywhere (it imports nothing else of hora).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


@dataclass(frozen=True)
class Knob:
    field: str
    type: type
    default: Any
    env: str  # suffix after HORA_ / HOROVOD_
    doc: str
    flag: str | None = None  # `hora run` flag, when there is one
    section: str | None = None  # Horovod config-file section
    key: str | None = None  # key inside that section

    @property
    def env_names(self) -> tuple[str, str]:
        return ("HORA_" + self.env, "HOROVOD_" + self.env)


MiB = 1 << 20

KNOBS: tuple[Knob, ...] = (
    Knob(
        "fusion_threshold",
        int,
        128 * MiB,
        "FUSION_THRESHOLD",
        "Largest fused buffer in bytes; 0 disables tensor fusion.",
        "--fusion-threshold-mb",
        "params",
        "fusion_threshold_mb",
    ),
    Knob(
        "cycle_time_ms",
        float,
        1.0,
        "CYCLE_TIME",
        "Engine cycle time in milliseconds (an idle engine still wakes at once on a new op).",
        "--cycle-time-ms",
        "params",
        "cycle_time_ms",
    ),
    Knob(
        "cache_capacity",
        int,
        1024,
        "CACHE_CAPACITY",
        "Response-cache entries; 0 turns the cache off.",
        "--cache-capacity",
        "params",
        "cache_capacity",
    ),
    Knob(
        "hierarchical_allreduce",
        bool,
        False,
        "HIERARCHICAL_ALLREDUCE",
        "Reduce inside each host, then across hosts.",
        "--hierarchical-allreduce",
        "params",
        "hierarchical_allreduce",
    ),
    Knob(
        "hierarchical_allgather",
        bool,
        False,
        "HIERARCHICAL_ALLGATHER",
        "Gather inside each host, then across hosts.",
        "--hierarchical-allgather",
        "params",
        "hierarchical_allgather",
    ),
    Knob(
        "torus_allreduce",
        bool,
        False,
        "TORUS_ALLREDUCE",
        "Two-dimensional torus allreduce (accepted; runs as hierarchical).",
        "--torus-allreduce",
        "params",
        "torus_allreduce",
    ),
    Knob(
        "timeline",
        str,
        "",
        "TIMELINE",
        "Path of the chrome://tracing JSON timeline written by rank 0, or DYNAMIC.",
        "--timeline-filename",
        "timeline",
        "filename",
    ),
    Knob(
        "timeline_mark_cycles",
        bool,
        False,
        "TIMELINE_MARK_CYCLES",
        "Mark every engine cycle in the timeline.",
        "--timeline-mark-cycles",
        "timeline",
        "mark_cycles",
    ),
    Knob(
        "autotune",
        bool,
        False,
        "AUTOTUNE",
        "Tune fusion threshold and cycle time online.",
        "--autotune",
        "autotune",
        "enabled",
    ),
    Knob(
        "autotune_log",
        str,
        "",
        "AUTOTUNE_LOG",
        "CSV file of autotuning samples.",
        "--autotune-log-file",
        "autotune",
        "log_file",
    ),
    Knob(
        "autotune_warmup_samples",
        int,
        3,
        "AUTOTUNE_WARMUP_SAMPLES",
        "Autotune samples discarded at the start.",
        "--autotune-warmup-samples",
        "autotune",
        "warmup_samples",
    ),
    Knob(
        "autotune_steps_per_sample",
        int,
        10,
        "AUTOTUNE_STEPS_PER_SAMPLE",
        "Engine cycles per autotune sample.",
        "--autotune-steps-per-sample",
        "autotune",
        "steps_per_sample",
    ),
    Knob(
        "autotune_bayes_opt_max_samples",
        int,
        20,
        "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "Most Bayesian-optimisation samples.",
        "--autotune-bayes-opt-max-samples",
        "autotune",
        "bayes_opt_max_samples",
    ),
    Knob(
        "autotune_gaussian_process_noise",
        float,
        0.8,
        "AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        "Noise of the autotuner's Gaussian process.",
        "--autotune-gaussian-process-noise",
        "autotune",
        "gaussian_process_noise",
    ),
    Knob(
        "stall_check_disable",
        bool,
        False,
        "STALL_CHECK_DISABLE",
        "Turn the stall inspector off.",
        "--no-stall-check",
        "stall_check",
        "enabled",
    ),
    Knob(
        "stall_check_time_seconds",
        float,
        60.0,
        "STALL_CHECK_TIME_SECONDS",
        "Seconds before the stall inspector warns about ranks that did not submit a tensor.",
        "--stall-check-warning-time-seconds",
        "stall_check",
        "warning_time_seconds",
    ),
    Knob(
        "stall_shutdown_time_seconds",
        float,
        0.0,
        "STALL_SHUTDOWN_TIME_SECONDS",
        "Seconds of stall after which the job shuts down (0: never).",
        "--stall-check-shutdown-time-seconds",
        "stall_check",
        "shutdown_time_seconds",
    ),
    Knob(
        "log_level",
        str,
        "WARNING",
        "LOG_LEVEL",
        "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL.",
        "--log-level",
        "logging",
        "level",
    ),
    Knob(
        "log_hide_time",
        bool,
        False,
        "LOG_HIDE_TIME",
        "Leave the time out of log lines.",
        "--log-without-timestamp",
        "logging",
        "hide_timestamp",
    ),
    Knob(
        "controller",
        str,
        "",
        "CONTROLLER",
        "Negotiation controller: native (default), gloo or mpi.",
        None,
        "controller",
        None,
    ),
    Knob(
        "cpu_operations",
        str,
        "",
        "CPU_OPERATIONS",
        "Backend for CPU data: native (default), gloo, mpi or ccl.",
        None,
        None,
        None,
    ),
    Knob(
        "gpu_operations",
        str,
        "",
        "GPU_OPERATIONS",
        "Backend for GPU data: nccl or mpi.",
        None,
        None,
        None,
    ),
    Knob(
        "dynamic_process_sets",
        bool,
        False,
        "DYNAMIC_PROCESS_SETS",
        "Allow add_process_set/remove_process_set after init.",
        None,
        None,
        None,
    ),
    Knob(
        "elastic", bool, False, "ELASTIC", "Set by the launcher for elastic jobs.", None, None, None
    ),
    Knob(
        "elastic_timeout",
        float,
        600.0,
        "ELASTIC_TIMEOUT",
        "Elastic: seconds to wait for the job to be re-formed after a failure or a host change.",
        None,
        None,
        None,
    ),
    Knob(
        "gloo_timeout_seconds",
        float,
        30.0,
        "GLOO_TIMEOUT_SECONDS",
        "Seconds to wait for peers while connecting.",
        "--gloo-timeout-seconds",
        None,
        None,
    ),
    Knob("gloo_iface", str, "", "GLOO_IFACE", "Network interface to listen on.", None, None, None),
    Knob(
        "mpi_threads_disable",
        bool,
        False,
        "MPI_THREADS_DISABLE",
        "Initialise MPI with MPI_THREAD_SERIALIZED instead of MPI_THREAD_MULTIPLE "
        "(hvd.mpi_threads_supported() is then False).",
        "--mpi-threads-disable",
        None,
        None,
    ),
    Knob(
        "shm_disable",
        bool,
        False,
        "SHM_DISABLE",
        "Use TCP even between ranks on the same host.",
        None,
        None,
        None,
    ),
    Knob(
        "liveness_timeout_seconds",
        float,
        5.0,
        "LIVENESS_TIMEOUT_SECONDS",
        "Seconds without a heartbeat after which a peer counts as dead.",
        None,
        None,
        None,
    ),
    Knob(
        "cpu_bind",
        str,
        "none",
        "CPU_BIND",
        "none (default): leave placement to the OS; auto: give each local rank its own slice "
        "of the host's cores (when nothing bound the process already). auto speeds up hora's "
        "small collectives but confines everything else the process runs (torch threads, "
        "DataLoader workers, torch.distributed) to that slice, which can slow training.",
        "--cpu-bind",
        None,
        None,
    ),
    Knob(
        "thread_affinity",
        str,
        "",
        "THREAD_AFFINITY",
        "Cores to pin the engine thread to, one per local rank (comma-separated; local rank i "
        "takes the i-th).",
        "--thread-affinity",
        None,
        None,
    ),
)

KNOB_BY_FIELD: dict[str, Knob] = {k.field: k for k in KNOBS}


def _parse(knob: Knob, raw: str) -> Any:
    raw = raw.strip()
    if knob.type is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{knob.env_names[0]}={raw!r}: expected 0/1, true/false")
    try:
        return knob.type(raw)
    except ValueError:
        raise ValueError(f"{knob.env_names[0]}={raw!r}: expected a {knob.type.__name__}") from None


@dataclass
class Settings:
    """One typed value per knob. Build with :func:`load`; never mutated by the library."""

    fusion_threshold: int = 128 * MiB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    torus_allreduce: bool = False
    timeline: str = ""
    timeline_mark_cycles: bool = False
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    log_level: str = "WARNING"
    log_hide_time: bool = False
    controller: str = ""
    cpu_operations: str = ""
    gpu_operations: str = ""
    dynamic_process_sets: bool = False
    elastic: bool = False
    elastic_timeout: float = 600.0
    gloo_timeout_seconds: float = 30.0
    gloo_iface: str = ""
    mpi_threads_disable: bool = False
    shm_disable: bool = False
    liveness_timeout_seconds: float = 5.0
    cpu_bind: str = "none"
    thread_affinity: str = ""
    explicit: frozenset[str] = field(default_factory=frozenset)  # fields set by env

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read every knob from ``env`` (default ``os.environ``): ``HORA_X`` wins over ``HOROVOD_X``."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    explicit = set()
    for knob in KNOBS:
        for name in knob.env_names:
            if name in env:
                values[knob.field] = _parse(knob, env[name])
                explicit.add(knob.field)
                break
    # Horovod also accepts HOROVOD_GPU_ALLREDUCE=NCCL as a GPU-operations selector.
    if "gpu_operations" not in values:
        for name in ("HORA_GPU_ALLREDUCE", "HOROVOD_GPU_ALLREDUCE"):
            if env.get(name):
                values["gpu_operations"] = env[name]
                explicit.add("gpu_operations")
                break
    return Settings(**values, explicit=frozenset(explicit))


def to_env(settings: Settings, only_explicit: bool = True) -> dict[str, str]:
    """The ``HORA_*`` and ``HOROVOD_*`` variables that reproduce ``settings`` in a worker."""
    out: dict[str, str] = {}
    for knob in KNOBS:
        if only_explicit and knob.field not in settings.explicit:
            continue
        value = getattr(settings, knob.field)
        text = ("1" if value else "0") if knob.type is bool else str(value)
        for name in knob.env_names:
            out[name] = text
    return out


def env_lookup(env: Mapping[str, str], suffix: str, default: str | None = None) -> str | None:
    """``HORA_<suffix>`` or else ``HOROVOD_<suffix>`` from ``env``, for identity variables."""
    for name in ("HORA_" + suffix, "HOROVOD_" + suffix):
        if name in env:
            return env[name]
    return default
