"""Every op, dtype and reduction at world sizes 1, 2 and 3 (3 catches ring and
power-of-two edge cases), on real processes over the native TCP backend."""

from __future__ import annotations

import pytest

from conformance.battery import CHECKS, run_battery
from harness import run_ranks

SIZES = [1, 2, 3]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    np_ = request.param
    return np_, run_ranks(run_battery, np_, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_conformance(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert check in results, f"rank {rank} did not reach {check} (an earlier check broke it)"
        assert results[check] == "ok", f"np={np_} rank {rank}:\n{results[check]}"
