"""Telling a vanished host from a paused peer (hora.transport.tcp.liveness), on real sockets.

A vanished host is made by taking the loopback link down inside a network namespace of its
own (root only; skipped elsewhere, with the reason): the kernel then retransmits unacknowledged
data into nothing, as it does toward a host that is gone, and the watch fails the connection
with its own words long before ``TCP_USER_TIMEOUT`` would. A paused reader, whose kernel keeps
acknowledging, is not taken for a vanished host: test_tcp_pair's 12 s pause runs the watch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hora.lab.netns import unavailable_reason
from hora.transport.tcp.liveness import AckWatch

pytestmark = pytest.mark.timeout(60)
_NO_NETNS = unavailable_reason()


_VANISHED = textwrap.dedent(
    """
    import subprocess, sys, time
    from hora.errors import TransportError

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    sys.path.insert(0, TESTS)
    from tcp_loopback import watched_pairs

    left, right, watch = watched_pairs(silence_s=1.0, check_s=0.2)
    left.send_msg(b"hello")
    assert right.recv_msg() == b"hello"
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)  # the host vanishes
    start = time.monotonic()
    try:
        left.send(b"x" * (8 << 20))
    except TransportError as e:
        print(f"RAISED after {time.monotonic() - start:.1f} s: {e}")
        sys.exit(0)
    print("the send finished")
    sys.exit(1)
    """
)


@pytest.mark.skipif(_NO_NETNS is not None, reason=f"cannot make a network namespace: {_NO_NETNS}")
def test_a_vanished_host_fails_the_connection_with_the_reason() -> None:
    """Inside a namespace of its own, the link goes down under a send of 8 MiB: the send
    raises the watch's error (not TCP_USER_TIMEOUT's, a minute later), naming the peer."""
    name = f"hora-liveness-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c",
             _VANISHED.replace("TESTS", repr(str(Path(__file__).parents[2])))],
            capture_output=True, text=True, timeout=45,
        )  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "RAISED" in out and "connection to rank 1 (data channel)" in out, out
    assert "no acknowledgement from its host" in out, out


class _ScriptedConnection:
    """A fake connection whose silences follow a script: the clock jump of a machine back from
    a suspension cannot be made here (its kernel retransmits at once on resume, and the
    acknowledgement comes before the next look)."""

    def __init__(self, silences: list[float | None]) -> None:
        self.silences = silences
        self.closed = False
        self.reasons: list[str] = []

    def unacked_silence(self) -> float | None:
        return self.silences.pop(0)

    def abort(self, reason: str) -> None:
        self.reasons.append(reason)
        self.closed = True


def test_one_silent_look_is_not_enough_two_in_a_row_are() -> None:
    resumed = _ScriptedConnection([15.0, None, 0.1, 12.0, 0.2])  # acknowledged after each
    vanished = _ScriptedConnection([10.0, 11.0])
    watch = AckWatch(lambda: [resumed, vanished], "test-watch", silence_s=10.0)
    for _ in range(5):
        watch.check()
    assert resumed.reasons == [] and not resumed.closed
    assert (
        len(vanished.reasons) == 1
        and "no acknowledgement from its host for 11 s" in (vanished.reasons[0])
    )
