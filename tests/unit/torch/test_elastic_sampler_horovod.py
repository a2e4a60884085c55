"""ElasticSampler behaves as horovod.torch.elastic.ElasticSampler (v0.28.1) does: its order,
its padding, re-iteration, record_batch's counting, set_epoch, len and state_dict."""

from __future__ import annotations

import random

from torch.utils.data import DataLoader

from hora.torch.elastic import ElasticSampler


def sampler(n: int, replicas: int = 2, rank: int = 0, **kw) -> ElasticSampler:
    return ElasticSampler(range(n), num_replicas=replicas, rank=rank, **kw)


def test_iterating_again_without_set_epoch_gives_the_epoch_again() -> None:
    s = sampler(12, seed=5)
    loader = DataLoader(list(range(12)), batch_size=3, sampler=s)
    first = [b.tolist() for b in loader]
    for i in range(len(first)):
        s.record_batch(i, 3)
    assert s.processed_num == 12 == len(s.dataset)
    again = [b.tolist() for b in loader]
    assert again == first and sum(len(b) for b in again) == 6
    assert s.processed_num == 12 and len(s) == 6


def test_order_is_pythons_random_shuffle_of_seed_plus_epoch() -> None:
    s = sampler(20, replicas=1, seed=7)
    s.set_epoch(3)
    want = list(range(20))
    random.Random(10).shuffle(want)
    assert list(s) == want
    assert list(sampler(20, replicas=1, shuffle=False)) == list(range(20))


def test_shards_and_padding() -> None:
    parts = [list(sampler(10, 4, r, shuffle=False)) for r in range(4)]
    assert parts == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [len(sampler(10, 4, r)) for r in range(4)] == [3, 3, 3, 3]
    s = sampler(10, 4, 0, shuffle=False)
    assert (s.num_samples, s.total_size, len(s.remaining_indices)) == (3, 12, 10)


def test_record_batch_adds_one_batch_per_call_and_does_not_reshard() -> None:
    s = sampler(40, seed=1)
    shard, length = list(s), len(s)
    s.record_batch(7, 4)  # batch_idx is not used
    s.record_batch(7, 4)
    assert s.processed_num == 16
    assert list(s) == shard and len(s) == length  # until reset()
    s.reset()
    assert len(s) == 12 and list(s) != shard


def test_set_epoch_always_starts_the_epoch_over() -> None:
    s = sampler(20, seed=2)
    s.set_epoch(1)
    s.record_batch(0, 5)
    s.set_epoch(1)  # the same epoch again: from its first sample
    assert s.state_dict() == {"epoch": 1, "processed_num": 0} and len(s) == 10


def test_state_dict_round_trip_reshards_the_rest() -> None:
    a = [sampler(30, 2, r, seed=4) for r in range(2)]
    done = set()
    for s in a:
        done.update(list(s)[:6])
        for i in range(3):
            s.record_batch(i, 2)
    state = a[0].state_dict()
    assert state == {"epoch": 0, "processed_num": 12}
    b = [sampler(30, 3, r, seed=4) for r in range(3)]
    for s in b:
        s.load_state_dict(state)
    rest = [list(s) for s in b]
    assert [len(r) for r in rest] == [6, 6, 6]
    assert set(sum(rest, [])) == set(range(30)) - done
