"""The data order: which records each training step takes, a pure function of (seed, step) so a resumed run
needs only the step."""

from __future__ import annotations

import random


class DataOrder:
    """Raw batch k (across epochs) is a pure function of (seed, k): resume needs only k."""

    def __init__(self, n_records: int, batch_size: int, seed: int) -> None:
        if batch_size > n_records:
            raise ValueError(f"prompts_per_step ({batch_size}) exceeds the dataset size ({n_records})")
        self.n, self.bs, self.seed = n_records, batch_size, seed
        self.per_epoch = n_records // batch_size  # the tail of an epoch is dropped, reshuffled next epoch
        self._epoch: tuple[int, list[int]] | None = None  # the last epoch's shuffled order

    def batch(self, k: int) -> tuple[int, ...]:
        epoch, i = divmod(k, self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return tuple(self._epoch[1][i * self.bs : (i + 1) * self.bs])
