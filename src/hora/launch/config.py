"""What a launch needs, as one object: :class:`LaunchConfig`, and Horovod's YAML config files.

The CLI turns argv into a LaunchConfig; :func:`hora.launch.api.run` and integrations build one
directly. Knob values are resolved with Horovod's precedence: explicit flags, then the
``--config-file`` sections (mapped through ``Knob.section``/``Knob.key`` in
:mod:`hora.settings`), then the environment.

Plain data and pure functions; thread-safe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hora.launch.hosts import HostSlots
from hora.launch.local import is_local_host
from hora.settings import KNOB_BY_FIELD, KNOBS, Knob, MiB, Settings, check_paths, load, validate

BACKENDS = ("native", "gloo", "mpi")

# Config-file keys that are not knobs but launcher options: (section, key) -> LaunchConfig field.
# `controller` may also be hora's older mapping form (`controller: {gloo: true}`).
_LAUNCH_KEYS = {
    ("controller", "gloo"): "backend",
    ("controller", "mpi"): "backend",
    ("controller", "native"): "backend",
    ("library_options", "mpi_args"): "mpi_args",
    ("library_options", "network_interfaces"): "network_interfaces",
    ("library_options", "start_timeout"): "start_timeout",
    ("logging", "prefix_output_with_timestamp"): "prefix_timestamp",
}
# Keys read and then left alone (hora has nothing to do for them; the CLI says so once).
_NO_EFFECT_KEYS = {("library_options", "ccl_bgt_affinity")}
SECTIONS = ("controller", "params", "autotune", "timeline", "stall_check", "library_options",
            "logging", "verbose")  # fmt: skip


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
    tcp_flag: bool = False  # --tcp: NCCL_IB_DISABLE=1, and with --mpi no InfiniBand for Open MPI
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
        validate(self.settings)
        if is_local_host(self.host_list()[0].name):  # rank 0 writes its files here
            check_paths(self.settings)
        if self.output_filename:  # the launcher writes DIR/rank.N/{stdout,stderr}
            wrong = _folder_problem(self.output_filename)
            if wrong:
                raise ValueError(f"--output-filename={self.output_filename}: {wrong}")

    def host_list(self) -> list[HostSlots]:
        return self.hosts or [HostSlots("localhost", self.np)]


def _folder_problem(path: str) -> str | None:
    """Why the folder ``path`` cannot be created or written to, or None."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        return "is a file; give a folder"
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not a folder this user can write to"
    return None


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
    """Read a config file in horovodrun's YAML format (hora's own keys are accepted beside it).

    Returns ``(knobs, launch)``: knob values by Settings field, and launcher options by
    LaunchConfig field; ``launch["origin"]`` maps each knob field to ``"<path>: section.key"``
    and ``launch["no_effect"]`` lists the (section, key) pairs read that hora has no use for.
    As horovodrun does: ``controller: gloo|mpi`` picks the controller, an ``autotune`` section
    without ``enabled`` turns autotuning off, a ``stall_check`` section without ``enabled``
    keeps the stall check on, and ``logging.with_timestamp`` is the inverse of hiding the time.
    Unknown sections or keys raise ValueError naming every one of them.
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
    origin: dict[str, str] = {}
    launch: dict[str, Any] = {"origin": origin, "no_effect": []}
    unknown: list[str] = [str(section) for section in data if section not in SECTIONS]

    def put(knob: Knob, value: Any, where: str) -> None:
        knobs[knob.field] = value
        origin[knob.field] = where

    for section, entries in data.items():
        if section not in SECTIONS:
            continue
        if section == "verbose":
            launch["verbose"] = _as_bool(entries, f"{path}: verbose")
            continue
        if section == "controller" and not isinstance(entries, Mapping):
            name = str(entries).strip().lower()
            if name not in ("gloo", "mpi", "native"):
                raise ValueError(
                    f"{path}: controller: {entries!r}: no such controller; expected gloo, mpi "
                    "or native"
                )
            launch["backend"] = name
            continue
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            raise ValueError(f"{path}: section {section!r} must hold key: value pairs")
        if section == "autotune" and "enabled" not in entries:
            put(KNOB_BY_FIELD["autotune"], False, f"{path}: autotune")
        if section == "stall_check" and "enabled" not in entries:
            put(KNOB_BY_FIELD["stall_check_disable"], False, f"{path}: stall_check")
        for key, value in entries.items():
            where = f"{path}: {section}.{key}"
            if (section, key) in by_key:
                knob = by_key[(section, key)]
                converted = _knob_value(knob, value, where)
                if knob.field == "stall_check_disable":  # the file says `enabled`
                    converted = not converted
                put(knob, converted, where)
            elif (section, key) == ("logging", "with_timestamp"):
                put(KNOB_BY_FIELD["log_hide_time"], not _as_bool(value, where), where)
            elif (section, key) in _NO_EFFECT_KEYS:
                launch["no_effect"].append((section, key))
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
                    launch[name] = _knob_number(value, where)
                else:
                    launch[name] = str(value)
            else:
                unknown.append(f"{section}.{key}")
    if unknown:
        raise ValueError(
            f"{path}: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            "see docs/launch.md for the sections and keys"
        )
    return knobs, launch


def _knob_number(value: Any, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {value!r} is not a number") from None


def _split_list(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [v.strip() for v in str(value).split(",") if v.strip()]


def resolve_settings(
    env: Mapping[str, str],
    file_knobs: Mapping[str, Any],
    flag_knobs: Mapping[str, Any],
    origin: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from the environment, overridden by the config file, overridden by flags;
    validated. ``origin`` names where the file and flag values came from (for errors)."""
    base = load(env)
    merged = {**file_knobs, **flag_knobs}
    where = {**base.origin, **{f: f for f in merged}, **(origin or {})}
    return validate(
        base.replace(**merged, explicit=base.explicit | frozenset(merged), origin=where)
    )


def knob_from_flag(knob: Knob, value: Any) -> Any:
    """A flag's parsed value in the knob's unit (only ``--fusion-threshold-mb`` converts)."""
    return _knob_value(knob, value, knob.flag or knob.field)


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic part of a launch (``--min-np``, ``--max-np``, ``--host-discovery-script``,
    ...); the CLI hands it with the :class:`LaunchConfig` to :mod:`hora.elastic.driver`."""

    min_np: int
    max_np: int | None = None  # None: as many as there are slots
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None  # --blacklist-cooldown-range: hosts come back
