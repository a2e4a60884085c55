"""The names hora's torch process group gives torch's calls (hora.torch.distributed.names).

A name must repeat as the job's calls repeat (hora's response cache then serves them), whatever
the job ran before, and must not depend on the call it names (a call whose shape differs
between ranks must get the same name on every rank, or hora cannot report the mismatch).
The names object is taken from a real process group, unstarted (naming needs no engine).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("torch")

from hora.torch.distributed.group import HoraProcessGroup  # noqa: E402


def namer() -> Any:
    return HoraProcessGroup(None, 0, 2, [0, 1], None)._names


def names_of(keys: list[Any]) -> list[str]:
    names = namer()
    return [names.name((k,)) for k in keys]


def misses(keys: list[Any], names: list[str]) -> list[int]:
    """Positions whose name was last used by another key: each one is negotiated in full."""
    last: dict[str, Any] = {}
    out = []
    for i, (k, n) in enumerate(zip(keys, names)):
        if n in last and last[n] != k:
            out.append(i)
        last[n] = k
    return out


def test_a_loop_of_one_call_after_a_training_pattern_settles_on_one_name() -> None:
    # DDP's start (its parameter broadcasts), steps of three buckets, then a benchmark's loop
    keys = ["b0", "b1", "b2", "b3"] + ["B1", "B2", "B3"] * 20 + ["K"] * 300
    names = names_of(keys)
    loop = names[-290:]
    assert len(set(loop)) == 1, f"{len(set(loop))} names for one repeated call"


def test_training_steps_after_a_start_of_other_calls_repeat_their_names() -> None:
    start = [f"broadcast{i}" for i in range(7)]
    step = ["B1", "B2", "B2", "B3"]  # two buckets of the same size
    keys = start + step * 30
    names = names_of(keys)
    first = len(start) + 4 * len(step)  # learnt within the first steps
    assert not misses(keys[first:], names[first:]), names[first:first + 12]
    steady = names[-len(step):]
    assert len(set(steady)) == len(step), f"a step's calls share names: {steady}"
    assert names[-2 * len(step):-len(step)] == steady


@pytest.mark.parametrize("seed", range(4))
def test_any_periodic_sequence_is_learnt_within_a_few_periods(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        period = [rng.randint(0, rng.randint(0, 4)) for _ in range(rng.randint(1, 12))]
        prefix = [("pre", i) for i in range(rng.randint(0, 10))]
        keys = prefix + period * 30
        names = names_of(keys)
        late = [i for i in misses(keys, names) if i >= len(prefix) + 4 * len(period)]
        assert not late, (period, late[:5])


def test_a_name_does_not_depend_on_the_key_it_names() -> None:
    rng = random.Random(7)
    for _ in range(200):
        period = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        keys = period * rng.randint(1, 6) + period[: rng.randint(0, len(period))]
        at = len(keys)
        a = names_of(keys + [period[at % len(period)]])  # the call the loop makes next
        b = names_of(keys + ["other"])  # the same call with another shape on a peer
        assert a[at] == b[at], (keys, a[at], b[at])


def test_names_stay_bounded_over_calls_that_never_repeat() -> None:
    names = names_of(list(range(5000)))
    assert len(set(names)) <= 1024
