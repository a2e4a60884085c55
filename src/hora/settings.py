"""Every knob hora has, read, checked and exported in one place.

The knobs themselves are declared once, in :mod:`hora.knobs` (re-exported here, so
``from hora.settings import KNOBS, Knob`` keeps working). :func:`load` builds one typed
:class:`Settings` from the environment (``HORA_*`` first, Horovod's ``HOROVOD_*`` beside it); the
launcher exports a Settings back into the workers' environment with :func:`to_env`. Tests check
that the CLI, the table and the docs name the same knobs.

:func:`validate` and :func:`check_paths` check every value against its knob (range, choices, a
writable path) once, in the launcher before any worker starts and in ``init`` for processes
started otherwise, and raise :class:`SettingError` with one line naming the setting as it was
given.

No threads; safe to import from anywhere (it imports nothing of hora but :mod:`hora.knobs`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hora.knobs import (
    CONTROLLERS,
    CPU_BIND,
    CPU_OPERATIONS,
    GPU_OPERATIONS,
    GPU_OPS,
    KNOB_BY_FIELD,
    KNOBS,
    LOG_LEVELS,
    NOT_BUILT,
    Knob,
    MiB,
)

__all__ = [
    "CONTROLLERS", "CPU_BIND", "CPU_OPERATIONS", "GPU_OPERATIONS", "GPU_OPS", "KNOBS",
    "KNOB_BY_FIELD", "LOG_LEVELS", "MiB", "NOT_BUILT", "Knob", "SettingError", "Settings",
    "check_paths", "env_lookup", "load", "path_problem", "problem", "to_env", "validate", "where",
]  # fmt: skip

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


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


_GPU_OP_FIELDS = tuple(f"gpu_{op}" for op in GPU_OPS)
_BACKEND_FIELDS = ("cpu_operations", "gpu_operations", "controller", *_GPU_OP_FIELDS)
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
        if low in NOT_BUILT and knob.field in _BACKEND_FIELDS:
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
    _check_gpu_ops(settings)
    return settings


def _gpu_choices(settings: Settings) -> list[tuple[str, str]]:
    """(how it was given, backend in lower case) for HOROVOD_GPU_OPERATIONS and every
    HOROVOD_GPU_<OP> that is set."""
    out = []
    for f in ("gpu_operations", *_GPU_OP_FIELDS):
        value = str(getattr(settings, f)).strip()
        if value:
            out.append((where(settings, KNOB_BY_FIELD[f]), value.lower()))
    return out


def _check_gpu_ops(settings: Settings) -> None:
    """Every GPU backend named must be the same one: HOROVOD_GPU_<OP> overrides
    HOROVOD_GPU_OPERATIONS for its op in Horovod, but hora runs all ops through one backend."""
    named = _gpu_choices(settings)
    for origin, value in named[1:]:
        if value != named[0][1]:
            first = f"{named[0][0]}={named[0][1].upper()}"
            raise SettingError(
                f"{origin}={value.upper()} differs from {first}: hora runs every collective "
                "of a job through one backend (and Horovod refuses to mix NCCL and MPI on GPUs "
                "without HOROVOD_ALLOW_MIXED_GPU_IMPL=1); give them the same value, or set "
                "only HOROVOD_GPU_OPERATIONS"
            )


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
    fast_path: bool = True
    compress_on_one_host: bool = False
    local_sets: bool = True
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
    tf_logs: bool = False
    controller: str = ""
    cpu_operations: str = ""
    gpu_operations: str = ""
    gpu_allreduce: str = ""
    gpu_allgather: str = ""
    gpu_broadcast: str = ""
    gpu_alltoall: str = ""
    gpu_reducescatter: str = ""
    dynamic_process_sets: bool = False
    elastic: bool = False
    elastic_timeout: float = 600.0
    gloo_timeout_seconds: float = 30.0
    gloo_iface: str = ""
    handshake_timeout_seconds: float = 5.0
    listen_any: bool = False
    mpi_threads_disable: bool = False
    shm_disable: bool = False
    shm_single_copy: bool = True
    cpu_bind: str = "crowded"
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
    # HOROVOD_GPU_<OP> alone (Horovod's older spelling, HOROVOD_GPU_ALLREDUCE=NCCL) names the
    # GPU backend too: the first one set stands for them all (validate checks they agree).
    if not values.get("gpu_operations"):
        for f in _GPU_OP_FIELDS:
            if values.get(f):
                values["gpu_operations"], origin["gpu_operations"] = values[f], origin[f]
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
