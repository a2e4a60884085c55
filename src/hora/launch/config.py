"""What a launch needs, as one object: :class:`LaunchConfig`, and Horovod's YAML config files.

The CLI turns argv into a LaunchConfig; :func:`hora.launch.api.run` and integrations build one
directly. Knob values are resolved with Horovod's precedence: explicit flags, then the
``--config-file`` sections (mapped through ``Knob.section``/``Knob.key`` in
:mod:`hora.settings`), then the environment.

Plain data and pure functions; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hora.launch.hosts import HostSlots
from hora.settings import KNOBS, Knob, MiB, Settings, load

BACKENDS = ("native", "gloo", "mpi")

# Config-file keys that are not knobs but launcher options: (section, key) -> LaunchConfig field.
_LAUNCH_KEYS = {
    ("controller", "gloo"): "backend",
    ("controller", "mpi"): "backend",
    ("library_options", "mpi_args"): "mpi_args",
    ("library_options", "network_interfaces"): "network_interfaces",
    ("library_options", "start_timeout"): "start_timeout",
    ("logging", "prefix_output_with_timestamp"): "prefix_timestamp",
}


@dataclass
class LaunchConfig:
    """Everything one ``hora run`` needs. ``command`` is the worker's argv."""

    command: list[str]
    np: int = 1
    hosts: list[HostSlots] = field(default_factory=list)  # empty: localhost with np slots
    backend: str = "native"  # native, gloo or mpi
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config_file: str | None = None  # hora extension: ssh -F
    network_interfaces: list[str] = field(default_factory=list)
    start_timeout: float = 30.0
    verbose: bool = False
    output_filename: str | None = None
    prefix_timestamp: bool = False
    disable_cache: bool = False
    mpi_args: str = ""
    binding_args: str = ""  # with --mpi: mpirun's binding and mapping, instead of hora's default
    settings: Settings = field(default_factory=Settings)
    env: dict[str, str] | None = None  # base environment for workers; None: os.environ
    grace_seconds: float = 5.0  # between SIGTERM and SIGKILL when stopping workers
    cwd: str | None = None  # working directory of the workers; None: the launcher's

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError(
                "no command to run: give the program after the options, "
                "e.g. hora run -np 2 python train.py"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.np < 1:
            raise ValueError(f"-np {self.np}: the number of processes must be at least 1")
        if self.start_timeout <= 0:
            raise ValueError(f"--start-timeout {self.start_timeout}: must be positive")

    def host_list(self) -> list[HostSlots]:
        return self.hosts or [HostSlots("localhost", self.np)]


def _knob_value(knob: Knob, value: Any, where: str) -> Any:
    """A config-file or flag value converted to the knob's type and unit."""
    if knob.type is bool:
        return _as_bool(value, where)
    try:
        converted = knob.type(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {value!r} is not a {knob.type.__name__}") from None
    if knob.field == "fusion_threshold":  # given in MiB
        converted = int(float(value) * MiB)
    return converted


def _as_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    low = str(value).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{where}: {value!r} is not a boolean")


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a Horovod YAML config file.

    Returns ``(knobs, launch)``: knob values by Settings field, and launcher options by
    LaunchConfig field. Unknown sections or keys raise ValueError naming them.
    """
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"--config-file {str(path)!r}: cannot read it: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--config-file {str(path)!r}: not valid YAML: {e}") from e
    if not isinstance(data, Mapping):
        raise ValueError(f"--config-file {str(path)!r}: expected sections at the top level")
    by_key = {(k.section, k.key): k for k in KNOBS if k.section and k.key}
    knobs: dict[str, Any] = {}
    launch: dict[str, Any] = {}
    for section, entries in data.items():
        if section == "verbose":
            launch["verbose"] = _as_bool(entries, f"{path}: verbose")
            continue
        if not isinstance(entries, Mapping):
            raise ValueError(f"{path}: section {section!r} must hold key: value pairs")
        for key, value in entries.items():
            where = f"{path}: {section}.{key}"
            if (section, key) in by_key:
                knob = by_key[(section, key)]
                knobs[knob.field] = _knob_value(knob, value, where)
                if knob.field == "stall_check_disable":  # the file says `enabled`
                    knobs[knob.field] = not knobs[knob.field]
            elif (section, key) in _LAUNCH_KEYS:
                name = _LAUNCH_KEYS[(section, key)]
                if name == "backend":
                    if _as_bool(value, where):
                        launch["backend"] = key
                elif name == "network_interfaces":
                    launch[name] = _split_list(value)
                elif name == "prefix_timestamp":
                    launch[name] = _as_bool(value, where)
                elif name == "start_timeout":
                    launch[name] = float(value)
                else:
                    launch[name] = str(value)
            else:
                raise ValueError(f"{where}: unknown setting; see docs/launch.md for the keys")
    return knobs, launch


def _split_list(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [v.strip() for v in str(value).split(",") if v.strip()]


def resolve_settings(
    env: Mapping[str, str], file_knobs: Mapping[str, Any], flag_knobs: Mapping[str, Any]
) -> Settings:
    """Settings from the environment, overridden by the config file, overridden by flags."""
    base = load(env)
    merged = {**file_knobs, **flag_knobs}
    return base.replace(**merged, explicit=base.explicit | frozenset(merged))


def knob_from_flag(knob: Knob, value: Any) -> Any:
    """A flag's parsed value in the knob's unit (only ``--fusion-threshold-mb`` converts)."""
    return _knob_value(knob, value, knob.flag or knob.field)
