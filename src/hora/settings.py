"""Every knob hora has, declared once.

Each :class:`Knob` names its field, type, default, environment variables (``HORA_*`` first,
Horovod's ``HOROVOD_*`` accepted beside it), the ``hora run`` flag that sets it and the section of
a Horovod YAML config file it lives in. :func:`load` builds one typed :class:`Settings` from the
environment; the launcher exports a Settings back into the workers' environment with
:func:`to_env`. Tests check that the CLI, this table and the docs name the same knobs.

Every knob also says what values are valid (range, choices, a writable path);
:func:`validate` and :func:`check_paths` check them once, in the launcher before any worker
starts and in ``init`` for processes started otherwise, and raise :class:`SettingError` with
one line naming the setting as it was given.

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
    low: float | None = None  # smallest valid value (numbers)
    high: float | None = None  # largest valid value (numbers)
    positive: bool = False  # must be > 0 (numbers)
    choices: tuple[str, ...] | None = None  # valid values, compared without case (strings)
    path: bool = False  # a file rank 0 writes: its folder must exist and be writable

    @property
    def env_names(self) -> tuple[str, str]:
        return ("HORA_" + self.env, "HOROVOD_" + self.env)


MiB = 1 << 20

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
CONTROLLERS = ("native", "gloo", "mpi")
CPU_OPERATIONS = ("native", "gloo", "mpi", "nccl")
GPU_OPERATIONS = ("nccl", "mpi", "gloo", "native")
CPU_BIND = ("auto", "none")
# Libraries Horovod can be built with and hora does not have: name -> what to use instead.
NOT_BUILT = {
    "ccl": "Intel oneCCL",
    "ddl": "IBM DDL",
}

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
        low=0,
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
        low=0,
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
        low=0,
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
        "Timeline JSON file of rank 0 (with {rank} in the path: of every rank), or DYNAMIC.",
        "--timeline-filename",
        "timeline",
        "filename",
        path=True,
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
        path=True,
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
        low=0,
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
        low=1,
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
        low=0,
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
        low=0,
        high=1,
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
        low=0,
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
        low=0,
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
        choices=LOG_LEVELS,
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
        choices=CONTROLLERS,
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
        choices=CPU_OPERATIONS,
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
        choices=GPU_OPERATIONS,
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
        positive=True,
    ),
    Knob(
        "gloo_timeout_seconds",
        float,
        30.0,
        "GLOO_TIMEOUT_SECONDS",
        "Seconds to wait for peers while connecting.",
        "--gloo-timeout-seconds",
        "library_options",
        "gloo_timeout_seconds",
        positive=True,
    ),
    Knob("gloo_iface", str, "", "GLOO_IFACE", "Network interface to listen on.", None, None, None),
    Knob(
        "handshake_timeout_seconds",
        float,
        5.0,
        "HANDSHAKE_TIMEOUT_SECONDS",
        "Seconds an incoming connection has for its whole handshake before it is dropped "
        "(rendezvous store and every rank's listeners).",
        None,
        None,
        None,
        positive=True,
    ),
    Knob(
        "listen_any",
        bool,
        False,
        "LISTEN_ANY",
        "Listen on every interface (0.0.0.0) instead of loopback (local jobs) or the job's "
        "interface (multi-host jobs).",
        None,
        None,
        None,
    ),
    Knob(
        "mpi_threads_disable",
        bool,
        False,
        "MPI_THREADS_DISABLE",
        "Initialise MPI with MPI_THREAD_SERIALIZED instead of MPI_THREAD_MULTIPLE "
        "(hvd.mpi_threads_supported() is then False).",
        "--mpi-threads-disable",
        "library_options",
        "mpi_threads_disable",
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
        positive=True,
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
        "library_options",
        "cpu_bind",
        choices=CPU_BIND,
    ),
    Knob(
        "thread_affinity",
        str,
        "",
        "THREAD_AFFINITY",
        "Cores to pin the engine thread to, one per local rank (comma-separated; local rank i "
        "takes the i-th).",
        "--thread-affinity",
        "library_options",
        "thread_affinity",
    ),
    Knob(
        "num_nccl_streams",
        int,
        1,
        "NUM_NCCL_STREAMS",
        "NCCL streams per device (accepted for Horovod; hora's NCCL backend runs on one "
        "torch.distributed process group, so it changes nothing).",
        "--num-nccl-streams",
        "library_options",
        "num_nccl_streams",
        low=0,
    ),
)

KNOB_BY_FIELD: dict[str, Knob] = {k.field: k for k in KNOBS}


class SettingError(ValueError):
    """A setting hora cannot use. The message is one line: the setting as it was given (flag,
    variable or config-file key), its value, and what is valid."""


def _parse(knob: Knob, raw: str, name: str | None = None) -> Any:
    """``raw`` (the text of variable ``name``) as the knob's type; SettingError if it is not."""
    name = name or knob.env_names[0]
    raw = raw.strip()
    if knob.type is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise SettingError(f"{name}={raw!r}: expected 0/1, true/false")
    try:
        return knob.type(raw)
    except ValueError:
        raise SettingError(
            f"{name}={raw!r}: expected a{'n' if knob.type is int else ''} {knob.type.__name__}"
        ) from None


_ALIASES = ("tcp", "hora")  # accepted for native by the controller and CPU-operations knobs


def _what(knob: Knob) -> str:
    """The knob's doc up to its first full stop or parenthesis, in lower case."""
    text = knob.doc.split(" (")[0].split(". ")[0].rstrip(".")
    return text[:1].lower() + text[1:]


def problem(knob: Knob, value: Any) -> str | None:
    """What is wrong with ``value`` for ``knob`` (type already checked), or None."""
    if knob.type in (int, float) and not isinstance(value, bool):
        if knob.positive and value <= 0:
            return f"must be > 0 ({_what(knob)})"
        if knob.low is not None and value < knob.low:
            if knob.high is not None:
                return f"must be in [{knob.low:g}, {knob.high:g}] ({_what(knob)})"
            return f"must be >= {knob.low:g} ({_what(knob)})"
        if knob.high is not None and value > knob.high:
            return f"must be in [{knob.low or 0:g}, {knob.high:g}] ({_what(knob)})"
    if knob.choices is not None:
        low = str(value).strip().lower()
        valid = ", ".join(knob.choices)
        if low in NOT_BUILT and knob.field in ("cpu_operations", "gpu_operations", "controller"):
            return (
                f"{low.upper()} ({NOT_BUILT[low]}) support is not built into hora, as in a "
                f"Horovod build without HOROVOD_WITH_{low.upper()}; use one of {valid}"
            )
        known = {c.lower() for c in knob.choices}
        if knob.field in ("controller", "cpu_operations"):
            known |= set(_ALIASES)
        if low and low not in known:
            return f"expected one of {valid}"
    if knob.field == "thread_affinity" and str(value).strip():
        parts = [p.strip() for p in str(value).split(",")]
        if not all(p.isdigit() for p in parts):
            return "expected core ids (0, 1, ...) separated by commas, one per local rank"
    return None


def where(settings: Settings, knob: Knob) -> str:
    """How ``knob`` was given for ``settings``: its flag, variable or config key."""
    return settings.origin.get(knob.field) or knob.env_names[1]


def _shown(knob: Knob, value: Any, origin: str) -> str:
    if knob.field == "fusion_threshold" and not origin.startswith(("HORA_", "HOROVOD_")):
        return f"{value / MiB:g}"  # the flag and the config file take MiB
    return str(value)


def validate(settings: Settings) -> Settings:
    """Check every knob's range and choices; SettingError naming the first bad one."""
    for knob in KNOBS:
        value = getattr(settings, knob.field)
        wrong = problem(knob, value)
        if wrong:
            origin = where(settings, knob)
            raise SettingError(f"{origin}={_shown(knob, value, origin)}: {wrong}")
    return settings


def path_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` by this process, or None."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        return "is a folder; give a file name"
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if os.path.exists(full) and not os.access(full, os.W_OK):
        return "the file exists and is not writable"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


def check_paths(settings: Settings) -> None:
    """The files rank 0 will write (timeline, autotune log) can be created: SettingError if not.
    Run where rank 0 runs (the launcher, for a rank 0 on its own host; ``init`` on rank 0)."""
    for knob in KNOBS:
        value = getattr(settings, knob.field)
        if not knob.path or not value or value == "DYNAMIC":
            continue
        wrong = path_problem(str(value))
        if wrong:
            raise SettingError(f"{where(settings, knob)}={value}: {wrong}")


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
    handshake_timeout_seconds: float = 5.0
    listen_any: bool = False
    mpi_threads_disable: bool = False
    shm_disable: bool = False
    liveness_timeout_seconds: float = 5.0
    cpu_bind: str = "none"
    thread_affinity: str = ""
    num_nccl_streams: int = 1
    explicit: frozenset[str] = field(default_factory=frozenset)  # fields set by env
    # field -> how it was given ("HOROVOD_CYCLE_TIME", "--cycle-time-ms", "f.yaml: params.x"),
    # for error messages; fields not named here came from their default
    origin: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read every knob from ``env`` (default ``os.environ``): ``HORA_X`` wins over ``HOROVOD_X``.

    Validated (:func:`validate`): a value of the wrong type, out of range or not among the
    choices raises SettingError naming the variable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for knob in KNOBS:
        for name in knob.env_names:
            if name in env:
                values[knob.field] = _parse(knob, env[name], name)
                origin[knob.field] = name
                break
    # Horovod also accepts HOROVOD_GPU_ALLREDUCE=NCCL as a GPU-operations selector.
    if "gpu_operations" not in values:
        for name in ("HORA_GPU_ALLREDUCE", "HOROVOD_GPU_ALLREDUCE"):
            if env.get(name):
                values["gpu_operations"] = env[name]
                origin["gpu_operations"] = name
                break
    return validate(Settings(**values, explicit=frozenset(origin), origin=origin))


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
