"""The elastic launcher's host discovery script: what it prints becomes hosts and slots."""

from __future__ import annotations

import pytest

from hora.elastic.discovery import cooldown, discover
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


def test_a_slot_rests_longer_after_each_failure_within_the_range() -> None:
    assert [cooldown((2, 20), n, jitter=0.0) for n in (1, 2, 3, 4, 5)] == [2, 4, 8, 16, 20]
    assert cooldown((2, 20), 1, jitter=0.5) == 2.5
    assert cooldown((2, 20), 9, jitter=0.5) == 20  # the jitter never passes the upper bound
    # bounds are clamped to 1-3600 s, and an upper bound below the lower one is the lower one
    assert cooldown((0, 0), 1, jitter=0.0) == 1
    assert cooldown((5000, 9000), 1, jitter=0.0) == 3600
    assert cooldown((10, 3), 1, jitter=0.0) == 10
    assert 1 <= cooldown((1, 2), 1) <= 2  # with its own random jitter


def test_a_host_printed_twice_is_one_host() -> None:
    """Horovod deduplicates the discovery script's lines."""
    assert discover("printf 'a:2\\nb:1\\na:2\\n'", None) == [HostSlots("a", 2), HostSlots("b", 1)]
