"""Host strings, hostfiles and Horovod's rank assignment."""

from __future__ import annotations

import pytest

from hora.launch.hosts import HostSlots, assign_ranks, parse_hostfile, parse_hosts


def test_parse_hosts() -> None:
    assert parse_hosts("a:2,b.example.com:4, c") == [
        HostSlots("a", 2), HostSlots("b.example.com", 4), HostSlots("c", 1)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty host list"),
        ("a:2,,b:1", "empty entry"),
        ("a:two", "slot count 'two'"),
        ("a:0", "at least 1"),
        ("a b:1", "malformed host name"),
        ("a:1,a:2", "listed twice"),
    ],
)
def test_parse_hosts_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hosts(text)


def test_parse_hostfile(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\n\nnode2   slots = 2  # fast\nnode3\n")
    assert parse_hostfile(path) == [HostSlots("node1", 4), HostSlots("node2", 2),
                                    HostSlots("node3", 1)]  # fmt: skip


def test_parse_hostfile_errors(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("node1 slots=4\nnode2 cpus=3\n")
    with pytest.raises(ValueError, match=r"hosts:2: expected 'host slots=N'"):
        parse_hostfile(path)
    path.write_text("node1 slots=-1\n")
    with pytest.raises(ValueError, match="at least 1"):
        parse_hostfile(path)
    with pytest.raises(ValueError, match="cannot read"):
        parse_hostfile(tmp_path / "missing")


def _table(hosts: str, np: int) -> list[tuple[str, int, int, int, int, int]]:
    return [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
        for s in assign_ranks(parse_hosts(hosts), np)
    ]


def test_assign_two_by_two() -> None:
    assert _table("a:2,b:2", 4) == [
        ("a", 0, 0, 2, 0, 2),
        ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 2, 1, 2),
        ("b", 3, 1, 2, 1, 2),
    ]


def test_assign_uneven_hosts() -> None:
    # a gets 3, b 1, c 2: local rank 0 exists on a, b, c; 1 on a, c; 2 on a only.
    assert _table("a:3,b:1,c:4", 6) == [
        ("a", 0, 0, 3, 0, 3),
        ("a", 1, 1, 3, 0, 2),
        ("a", 2, 2, 3, 0, 1),
        ("b", 3, 0, 1, 1, 3),
        ("c", 4, 0, 2, 2, 3),
        ("c", 5, 1, 2, 1, 2),
    ]


def test_assign_fills_in_order_and_leaves_unused_hosts() -> None:
    assert _table("a:4,b:4", 3) == [
        ("a", 0, 0, 3, 0, 1),
        ("a", 1, 1, 3, 0, 1),
        ("a", 2, 2, 3, 0, 1),
    ]
    assert all(s.size == 3 for s in assign_ranks(parse_hosts("a:4,b:4"), 3))


def test_assign_too_few_slots() -> None:
    with pytest.raises(ValueError, match="only 3 slots"):
        assign_ranks(parse_hosts("a:1,b:2"), 4)
    with pytest.raises(ValueError, match="at least 1"):
        assign_ranks(parse_hosts("a:1"), 0)


def test_identity_env_has_both_names() -> None:
    env = assign_ranks(parse_hosts("a:1,b:1"), 2)[1].identity_env()
    assert env["HORA_RANK"] == env["HOROVOD_RANK"] == "1"
    assert env["HORA_CROSS_RANK"] == "1" and env["HOROVOD_CROSS_SIZE"] == "2"
    assert env["HORA_HOSTNAME"] == "b"
