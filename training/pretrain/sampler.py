"""The batch sampler that keeps false negatives out of every batch, and shards batches over ranks."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rmm.training.pretrain.data import Pair


def _query_key(text: str) -> str:
    return " ".join(text.lower().split())


class NoDuplicateBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Shuffled batches in which no pair is a false negative for another.

    A pair joins a batch only if its question text is new to the batch, none of the passages it
    brings (positive + hard negatives) is gold for a query already there, and none of the
    passages already there is gold for it. Pairs that fit nowhere open a new batch, so every pair
    is used once per epoch. With `num_replicas` > 1 global batches of batch_size × replicas are
    built identically on every rank (same seed, same epoch) and each rank takes its slice; global
    batch sizes are kept multiples of the world size so every rank's shard has the same size.

    With `lengths` (tokens per pair), the shuffled order is sorted by length within pools of
    `bucket_pool` global batches before packing, so a batch holds pairs of similar length and
    dynamic padding wastes little; batches are still shuffled, and every pair still used once.
    """

    def __init__(self, pairs: Sequence[Pair], batch_size: int, seed: int = 0, shuffle: bool = True,
                 hard_negatives: dict[int, list[str]] | None = None, num_replicas: int = 1, rank: int = 0,
                 lengths: Sequence[int] | None = None, bucket_pool: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if lengths is not None and len(lengths) != len(pairs):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(pairs)} pairs")
        self.pairs, self.batch_size, self.seed, self.shuffle = pairs, batch_size, seed, shuffle
        self.lengths, self.bucket_pool = lengths, max(1, bucket_pool)
        self.hard_negatives = hard_negatives or {}
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        order = list(range(len(self.pairs)))
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        size = self.batch_size * self.num_replicas
        if self.lengths is not None:
            lengths, pool = self.lengths, size * self.bucket_pool
            order = [i for start in range(0, len(order), pool)
                     for i in sorted(order[start:start + pool], key=lambda j: lengths[j])]
        batches: list[dict[str, Any]] = []
        open_batches: list[dict[str, Any]] = []
        for index in order:
            pair = self.pairs[index]
            shown = {pair.passage, *self.hard_negatives.get(index, [])}
            target = None
            for batch in open_batches:
                if (_query_key(pair.query) not in batch["queries"] and not (shown & batch["gold"])
                        and not (pair.gold_passages & batch["shown"])):
                    target = batch
                    break
            if target is None:
                target = {"items": [], "queries": set(), "gold": set(), "shown": set()}
                batches.append(target)
                open_batches.append(target)
            target["items"].append(index)
            target["queries"].add(_query_key(pair.query))
            target["gold"] |= pair.gold_passages
            target["shown"] |= shown
            if len(target["items"]) == size:
                open_batches.remove(target)
        result = [b["items"] for b in batches]
        if self.num_replicas > 1:  # equal shards: trim each global batch to a multiple of the world size
            result = [b[: len(b) - len(b) % self.num_replicas] for b in result]
            result = [b for b in result if b]
        if self.shuffle:
            rng.shuffle(result)
        self._cache = (self.epoch, result)
        return result

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            shard = len(batch) // self.num_replicas
            yield batch[self.rank * shard:(self.rank + 1) * shard]

    def __len__(self) -> int:
        return len(self.global_batches())
