"""The hosts an elastic job may use: the discovery script's answer, and how long a blacklisted
host rests before it may come back. Pure functions, called from the launcher's main thread by
:mod:`hora.elastic.driver`.
"""

from __future__ import annotations

import random
import subprocess

from hora.errors import LaunchError
from hora.launch.hosts import HostSlots, parse_hosts

DISCOVERY_INTERVAL = 1.0  # seconds between runs of the discovery script (Horovod's frequency)


def cooldown(bounds: tuple[int, int], failures: int, jitter: float | None = None) -> float:
    """Seconds a blacklisted host rests after its ``failures``-th failure: the lower bound
    doubled for each earlier failure, plus up to a second of jitter, within ``bounds`` (each
    clamped to 1-3600 s, as Horovod does)."""
    low, high = (min(max(int(b), 1), 3600) for b in bounds)
    high = max(high, low)
    extra = random.random() if jitter is None else jitter
    return float(min(high, low * 2 ** min(failures - 1, 12) + extra))


def discover(script: str, slots_per_host: int | None, timeout: float = 30.0) -> list[HostSlots]:
    """Run the discovery script: one ``host`` or ``host:slots`` per line on its stdout."""
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"--host-discovery-script {script!r} ran longer than {timeout:g}s"
        ) from None
    if done.returncode != 0:
        raise LaunchError(
            f"--host-discovery-script {script!r} exited with {done.returncode}: "
            f"{done.stderr.strip()[-500:]}"
        )
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    if slots_per_host:
        lines = [ln if ":" in ln else f"{ln}:{slots_per_host}" for ln in lines]
    return parse_hosts(",".join(dict.fromkeys(lines))) if lines else []
