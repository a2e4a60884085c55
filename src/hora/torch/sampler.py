"""``DistributedSampler``: each rank reads a distinct, balanced shard, and can resume mid-epoch.

Every epoch the dataset indices are put in one order shared by all ranks (a permutation seeded
with ``seed + epoch`` when shuffling). The samples not yet processed in this epoch are padded
(or trimmed with ``drop_last``) to a multiple of the number of replicas and dealt round-robin:
rank ``r`` gets positions ``r, r + R, r + 2R, ...``. After ``b`` batches of ``n`` samples the
ranks together have consumed exactly the first ``b * n * R`` indices of the order, so the
position is one number, ``processed_num``, that ``state_dict`` saves and ``load_state_dict``
restores - also with a different number of replicas. ``ElasticSampler`` (Horovod's elastic
sampler) builds on that: it shards over the current ``hora.size()``/``hora.rank()`` and re-reads
them in ``reset()`` after hora was initialised again with other workers.

Used from the training thread (and DataLoader's main thread); not thread-safe.
"""

from __future__ import annotations

import math
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
    """Horovod's elastic sampler: a :class:`DistributedSampler` over the current world.

    ``reset()`` re-reads ``hora.size()``/``hora.rank()`` (``TorchState`` calls it after every
    reset and when it restores or syncs the sampler), so after the job re-formed with another
    number of workers each rank gets its new shard of the samples not processed yet this epoch.
    Call ``record_batch(i, batch_size)`` after each batch and ``set_epoch(e + 1)`` at the end
    of an epoch; ``state_dict()`` is ``{"epoch", "processed_num"}``.

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

    def reset(self) -> None:
        """Shard over the current world, starting from the samples not processed yet."""
        import hora

        num_replicas, rank = self._pinned
        self.num_replicas = hora.size() if num_replicas is None else num_replicas
        self.rank = hora.rank() if rank is None else rank
        self._iter_start = self.processed_num

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.reset()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        super().load_state_dict(state_dict)
        self.reset()
