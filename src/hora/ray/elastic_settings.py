"""The settings of :class:`hora.ray.ElasticRayExecutor` (Horovod's
``ElasticRayExecutor.create_settings``): :class:`RaySettings` plus the elastic job's bounds.

Plain data and a pure function, used in the Ray driver; thread-safe.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hora.ray.config import RaySettings, create_settings

# Horovod's ElasticSettings takes these through create_settings(**kwargs) too; they concern its
# ssh/MPI launcher and have no effect on a Ray job, whose workers are actors.
_LAUNCHER_ONLY = (
    "ssh_port", "extra_mpi_args", "tcp_flag", "binding_args", "output_filename",
    "run_func_mode", "elastic", "prefix_output_with_timestamp",
)  # fmt: skip


@dataclass(frozen=True)
class ElasticRaySettings(RaySettings):
    """What :meth:`ElasticRayExecutor.create_settings` returns.

    ``min_num_proc`` workers are needed to start and to go on, at most ``max_num_proc`` run
    (None: every slot of the cluster); ``reset_limit`` bounds the re-formations;
    ``elastic_timeout`` how long a round may take to form (None: ``HOROVOD_ELASTIC_TIMEOUT``,
    600 s); ``cooldown_range`` (seconds, min and max) lets a node whose worker failed come
    back; ``verbose`` logs the job's steps. ``extra`` holds the launcher-only arguments that
    were given (kept, without effect on Ray).
    """

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float | None = None
    cooldown_range: tuple[int, int] | None = None
    verbose: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_proc(self) -> int:
        """The workers the job starts with (Horovod's name): ``min_num_proc``."""
        return self.min_num_proc


def create_elastic_settings(
    min_num_proc: int = 1,
    max_num_proc: int | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float | None = None,
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    nics: Sequence[str] | str | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    **kwargs: Any,
) -> ElasticRaySettings:
    """Horovod's ``ElasticRayExecutor.create_settings``: the bounds of the elastic job and the
    Ray settings (``timeout_s``, ``nics``; ``ssh_identity_file`` is accepted, a Ray job opens
    no ssh sessions). ``min_np``/``max_np`` are the deprecated names of ``min_num_proc``/
    ``max_num_proc``. Keywords: ``cooldown_range``, ``verbose``, ``placement_group_timeout_s``,
    and Horovod's launcher-only ones (``ssh_port``, ``extra_mpi_args``, ...), kept unused."""
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc", DeprecationWarning, stacklevel=2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc", DeprecationWarning, stacklevel=2)
        max_num_proc = max_np
    cooldown_range = kwargs.pop("cooldown_range", None)
    verbose = int(kwargs.pop("verbose", 0) or 0)
    placement = kwargs.pop("placement_group_timeout_s", 100)
    unknown = sorted(set(kwargs) - set(_LAUNCHER_ONLY))
    if unknown:
        raise TypeError(
            f"ElasticRayExecutor.create_settings() got unexpected keyword arguments {unknown}; "
            f"it takes Horovod's ElasticSettings keywords: cooldown_range, verbose, "
            f"{', '.join(_LAUNCHER_ONLY)}"
        )
    _check_bounds("ElasticRayExecutor.create_settings", min_num_proc, max_num_proc)
    if elastic_timeout is not None and elastic_timeout <= 0:
        raise ValueError(f"elastic_timeout={elastic_timeout}: give positive seconds")
    if cooldown_range is not None:
        cooldown_range = _cooldown(cooldown_range)
    base = create_settings(
        timeout_s=timeout_s,
        ssh_identity_file=ssh_identity_file,
        placement_group_timeout_s=placement,
        nics=nics,
    )
    return ElasticRaySettings(
        timeout_s=base.timeout_s,
        ssh_identity_file=base.ssh_identity_file,
        placement_group_timeout_s=base.placement_group_timeout_s,
        nics=base.nics,
        min_num_proc=int(min_num_proc),
        max_num_proc=None if max_num_proc is None else int(max_num_proc),
        reset_limit=reset_limit,
        elastic_timeout=None if elastic_timeout is None else float(elastic_timeout),
        cooldown_range=cooldown_range,
        verbose=verbose,
        extra=dict(kwargs),
    )


def _check_bounds(caller: str, low: int, high: int | None) -> None:
    if low < 1 or (high is not None and high < low):
        raise ValueError(
            f"{caller}: minimum {low}, maximum {high} workers: need 1 <= minimum <= maximum"
        )


def _cooldown(value: Any) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"cooldown_range={value!r}: give (min, max) seconds, e.g. (10, 100)"
        ) from None
    if not 0 < low <= high:
        raise ValueError(f"cooldown_range={value!r}: need 0 < min <= max seconds")
    return low, high
