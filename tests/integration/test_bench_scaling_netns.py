"""``hora bench scaling --netns 2 --link-rate 1gbit --compression none,powersgd-r1`` for real, at
a short length: the MLP trained on two namespace hosts of two ranks each, uncompressed and with
PowerSGD, and the bytes the hosts' links carried per step (PowerSGD's far fewer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hora.lab import netns

_REASON = netns.unavailable_reason()


@pytest.mark.skipif(_REASON is not None, reason=f"cannot make namespace hosts: {_REASON}")
@pytest.mark.timeout(400)
def test_scaling_across_namespace_hosts_with_compression(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hora.lab", "scaling", "--model", "mlp", "--np", "4",
           "--netns", "2", "--link-rate", "1gbit", "--backends", "native",
           "--compression", "none,powersgd-r1", "--steps", "2", "--warmup", "3",
           "--batch-size", "8", "--timeout", "300", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"native", "native+powersgd-r1"}, done.stderr[-3000:]
    for row in rows.values():
        assert (row["servers"], row["per_server"], row["link_rate"]) == (2, 2, "1gbit")
    plain, low_rank = (rows[k]["link_bytes_per_step"] for k in ("native", "native+powersgd-r1"))
    # every step of the uncompressed run sends the MLP's gradients across (12.3 MB); PowerSGD's
    # three compressed steps of five send rank-1 factors only
    assert plain > rows["native"]["grad_bytes"] / 2
    assert low_rank < plain / 2
    assert "native+powersgd-r1" in done.stdout
    assert "link-bound step (ms)" in done.stdout  # the step the link's rate allows
