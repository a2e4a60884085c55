"""``DistributedSampler``: each rank reads a distinct, balanced shard, and can resume mid-epoch.

Every epoch the dataset indices are put in one order shared by all ranks (a permutation seeded
with ``seed + epoch`` when shuffling). The samples not yet processed in this epoch are padded
(or trimmed with ``drop_last``) to a multiple of the number of replicas and dealt round-robin:
rank ``r`` gets positions ``r, r + R, r + 2R, ...``. After ``b`` batches of ``n`` samples the
ranks together have consumed exactly the first ``b * n * R`` indices of the order, so the
position is one number, ``processed_num``, that ``state_dict`` saves and ``load_state_dict``
restores - also with a different number of replicas. ``ElasticSampler`` is Horovod's elastic
sampler with Horovod's exact semantics (its order, padding and counting are described on the
class): it shards over the current ``hora.size()``/``hora.rank()`` and re-reads them in
``reset()`` after hora was initialised again with other workers.

Used from the training thread (and DataLoader's main thread); not thread-safe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class DistributedSampler(Sampler[int]):
    """Shards ``dataset`` over the ranks; ``set_epoch`` reshuffles, ``record_batch`` tracks.

    Args:
        dataset: anything with ``len()``.
        num_replicas, rank: default ``hora.size()``/``hora.rank()``, or the set's size and rank
            when ``process_set`` is given.
        shuffle: a new permutation every epoch (seeded, identical on every rank).
        seed: base seed of the permutations; must be the same on every rank.
        drop_last: trim the tail so all shards are equal without repeating samples.
        process_set: shard over the members of this process set instead of all ranks.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        process_set: Any = None,
    ) -> None:
        if num_replicas is None or rank is None:
            import hora

            source = process_set if process_set is not None else hora
            num_replicas = source.size() if num_replicas is None else num_replicas
            rank = source.rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, num_replicas={num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.processed_num = 0
        self._iter_start = 0

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _per_replica(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        self._iter_start = self.processed_num
        indices = self._order()[self.processed_num :]
        total = self._per_replica(len(indices)) * self.num_replicas
        if total <= len(indices):
            indices = indices[:total]
        elif indices:
            repeats = math.ceil(total / len(indices))
            indices = (indices * repeats)[:total]
        return iter(indices[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self._per_replica(max(len(self.dataset) - self.processed_num, 0))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: new order, position reset. Repeating the current epoch keeps the
        position, so a training loop resumed from ``load_state_dict`` may call it again."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed_num = 0
            self._iter_start = 0

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batches ``0..batch_idx`` of the current iteration (on every rank) as processed."""
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"bad batch_idx={batch_idx} / batch_size={batch_size}")
        done = self._iter_start + (batch_idx + 1) * batch_size * self.num_replicas
        self.processed_num = min(done, len(self.dataset))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        processed = int(state_dict["processed_num"])
        if not 0 <= processed <= len(self.dataset):
            raise ValueError(
                f"processed_num={processed} is outside [0, len(dataset)={len(self.dataset)}]"
            )
        self.epoch = int(state_dict["epoch"])
        self.processed_num = processed
        self._iter_start = processed


class ElasticSampler(DistributedSampler):
    """Horovod's elastic sampler: shards the samples not processed yet this epoch over the
    current world, and shards them again in ``reset()`` after the world changed.

    Horovod's semantics, kept exactly: every epoch the indices are put in one order (shuffled
    with ``random.Random(seed + epoch)`` when ``shuffle``); ``reset()`` reads ``hora.size()``/
    ``hora.rank()`` and takes the order past ``processed_num`` as this epoch's remaining
    indices, padded by repeating from their start to a multiple of the replicas; iterating
    deals them round-robin (rank ``r`` gets positions ``r, r + R, ...``) and may be repeated,
    giving the same indices until the next ``reset()``; ``len()`` is this rank's share.
    ``record_batch(batch_idx, batch_size)`` adds ``batch_size * num_replicas`` to
    ``processed_num`` (``batch_idx`` is not used) without re-sharding; ``set_epoch(e)`` starts
    epoch ``e`` from its first sample; ``load_state_dict`` takes ``{"epoch", "processed_num"}``
    and re-shards. ``TorchState`` calls ``reset()`` after every reset and whenever it restores
    or syncs the sampler.

    ``num_replicas``/``rank`` (keyword-only, not in Horovod) pin the sharding instead of
    following hora's world; ``reset()`` then keeps them.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=shuffle, seed=seed)
        self._pinned = (num_replicas, rank)
        self.processed_indices: set[int] = set()
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Shard the samples not processed yet this epoch over the current world."""
        num_replicas, rank = self._pinned
        if num_replicas is None or rank is None:
            import hora

            num_replicas = hora.size() if num_replicas is None else num_replicas
            rank = hora.rank() if rank is None else rank
        self.num_replicas, self.rank = num_replicas, rank
        self.remaining_indices = self._order()[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        short = self.total_size - len(indices)
        while short > 0 and indices:
            indices += indices[:short]
            short = self.total_size - len(indices)
        self.indices = indices[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample (call it at the end of an epoch, with the
        next one, so that a partly done epoch is not processed again)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one more batch of ``batch_size`` on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()
