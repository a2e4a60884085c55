"""The elastic launcher's host discovery script: what it prints becomes hosts and slots."""

from __future__ import annotations

import pytest

from hora.elastic.driver import discover
from hora.errors import LaunchError
from hora.launch.hosts import HostSlots


def test_lines_become_hosts_and_bare_hosts_get_slots_per_host() -> None:
    script = "printf 'a:2\\n\\nb\\n'"
    assert discover(script, slots_per_host=3) == [HostSlots("a", 2), HostSlots("b", 3)]
    assert discover(script, slots_per_host=None) == [HostSlots("a", 2), HostSlots("b", 1)]


def test_no_output_is_no_hosts() -> None:
    assert discover("true", None) == []


def test_a_failing_or_hanging_script_is_a_clear_error() -> None:
    with pytest.raises(LaunchError, match="exited with 3: boom"):
        discover("echo boom >&2; exit 3", None)
    with pytest.raises(LaunchError, match="ran longer than 0.5s"):
        discover("sleep 5", None, timeout=0.5)
