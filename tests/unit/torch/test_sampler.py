"""DistributedSampler: disjoint balanced shards, epochs, and resuming mid-epoch."""

from __future__ import annotations

import pytest

from hora.torch.sampler import DistributedSampler


def shards(n, replicas, **kw):
    return [list(DistributedSampler(range(n), replicas, r, **kw)) for r in range(replicas)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_are_disjoint_cover_and_balanced(shuffle):
    parts = shards(12, 3, shuffle=shuffle)
    assert all(len(p) == 4 for p in parts)
    assert sorted(sum(parts, [])) == list(range(12))


def test_padding_repeats_and_drop_last_trims():
    padded = shards(10, 4, shuffle=False)
    assert [len(p) for p in padded] == [3, 3, 3, 3]
    assert set(sum(padded, [])) == set(range(10))
    trimmed = shards(10, 4, shuffle=False, drop_last=True)
    assert [len(p) for p in trimmed] == [2, 2, 2, 2]
    assert len(set(sum(trimmed, []))) == 8


def test_set_epoch_changes_order_and_same_seed_agrees():
    a = DistributedSampler(range(50), 2, 0, seed=7)
    b = DistributedSampler(range(50), 2, 0, seed=7)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    assert len(list(a)) == len(a) == 25


def test_resume_mid_epoch_continues_where_it_stopped_with_other_replicas():
    n, bs = 40, 3
    samplers = [DistributedSampler(range(n), 2, r, seed=3) for r in range(2)]
    for s in samplers:
        s.set_epoch(2)
    full = [list(s) for s in samplers]
    consumed = set()
    for r, s in enumerate(samplers):
        consumed.update(full[r][: 2 * bs])
        s.record_batch(1, bs)  # two batches done
    state = samplers[0].state_dict()
    assert state == {"epoch": 2, "processed_num": 2 * bs * 2}

    # Resume on four replicas: the rest of the epoch, nothing consumed twice, nothing lost.
    resumed = [DistributedSampler(range(n), 4, r, seed=3) for r in range(4)]
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(2)  # the training loop calling it again must not rewind
    rest = [list(s) for s in resumed]
    flat = set(sum(rest, []))
    assert flat.isdisjoint(consumed)
    assert flat | consumed == set(range(n))
    assert all(len(r) == len(resumed[0]) == 7 for r in rest)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank 2"):
        DistributedSampler(range(4), 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(range(4), 0, 0)
    s = DistributedSampler(range(4), 1, 0)
    with pytest.raises(ValueError, match="processed_num"):
        s.load_state_dict({"epoch": 0, "processed_num": 9})
