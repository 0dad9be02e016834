"""The LightningDataModule: pairs per split, pre-tokenised once, batched by `NoDuplicateBatchSampler`.

Every text a batch can hold (queries, positives, and the training users' turns that hard negatives
come from) is tokenised in one call at `setup`, so a step only pads token lists (dynamic padding: to
the longest in the pass) — no tokeniser work per step. A batch is one to three transformer passes
(`merge_passes`, see `collate`). Batches go to the GPU from pinned memory.
Hard negatives are re-mined with the current weights at the start of every epoch (when refresh is
on), which is why the trainer reloads the training loader each epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from rmm.encoders import Encoder
from rmm.encoders.cuda_graphs import bucket_length
from rmm.errors import DataError
from rmm.training.pretrain.data import UserSplit, build_pairs, turn_texts
from rmm.training.pretrain.mining import mine_hard_negatives
from rmm.training.pretrain.module import ContrastiveModule, resolve_merge_passes, sync_encoder_device
from rmm.training.pretrain.sampler import NoDuplicateBatchSampler
from rmm.training.pretrain_config import PretrainConfig
from rmm.types import Dataset


class PairDataModule(L.LightningDataModule):
    """Pairs per split, pre-tokenised once; batches from `NoDuplicateBatchSampler`."""

    def __init__(self, dataset: Dataset, encoder: Encoder, cfg: PretrainConfig, split: UserSplit,
                 module: ContrastiveModule | None = None) -> None:
        super().__init__()
        self.dataset, self.encoder, self.cfg, self.split, self.module = dataset, encoder, cfg, split, module
        self.pairs = {"train": build_pairs(dataset, split.train), "val": build_pairs(dataset, split.val),
                      "test": build_pairs(dataset, split.test)}
        if not self.pairs["train"]:
            raise DataError(f"no (question, gold turn) pairs among the training users {split.train}")
        self._tokens: dict[tuple[str, str], list[int]] = {}
        self.hard_negatives: dict[int, list[str]] = {}
        self._mined_epoch = -1

    def setup(self, stage: str | None = None) -> None:
        """Tokenise every text batches can hold, once (see the module docstring)."""
        self.pretokenize()

    def pretokenize(self) -> None:
        config = self.encoder.config
        pairs = [p for split in ("train", "val", "test") for p in self.pairs[split]]
        self._ids([p.query for p in pairs], config.query_prefix)
        passages = [p.passage for p in pairs]
        if self.cfg.hard_negatives:
            passages += [t for user in self.split.train for t in turn_texts(self.dataset, user).values()]
        self._ids(passages, config.passage_prefix)

    def lengths(self, split: str) -> list[int]:
        """Tokens per pair (query + positive), what length bucketing sorts by."""
        config = self.encoder.config
        pairs = self.pairs[split]
        queries = self._ids([p.query for p in pairs], config.query_prefix)
        passages = self._ids([p.passage for p in pairs], config.passage_prefix)
        return [len(q) + len(p) for q, p in zip(queries, passages)]

    def _ids(self, texts: Sequence[str], prefix: str) -> list[list[int]]:
        missing = [t for t in dict.fromkeys(texts) if (prefix, t) not in self._tokens]
        if missing:
            max_length = min(self.cfg.max_length, self.encoder.max_length)
            encoded = self.encoder.tokenizer([prefix + t for t in missing], truncation=True, max_length=max_length,
                                             padding=False, return_attention_mask=False,
                                             return_token_type_ids=False)["input_ids"]
            for text, ids in zip(missing, encoded):
                self._tokens[(prefix, text)] = ids or [self.encoder.pad_token_id]
        return [self._tokens[(prefix, t)] for t in texts]

    def _cpu_collate(self, sequences: list[list[int]]) -> dict[str, Tensor]:
        """Padded to the pass's longest text, or to its length bucket under `cuda_graphs` (few shapes, few graphs)."""
        device = self.encoder.device
        self.encoder.device = torch.device("cpu")  # Lightning moves the batch to the model's device
        length = None
        if self.cfg.cuda_graphs:
            length = bucket_length(max(len(s) for s in sequences), min(self.cfg.max_length, self.encoder.max_length))
        try:
            return self.encoder.collate(sequences, length=length)
        finally:
            self.encoder.device = device

    def collate(self, split: str, indices: list[int]) -> dict[str, Any]:
        """The batch's texts as transformer passes (`merge_passes`: a pass per text group, positives
        with their hard negatives, or all in one), and how many of its rows are queries, positives
        and hard negatives, in that order."""
        pairs = [self.pairs[split][i] for i in indices]
        config = self.encoder.config
        queries = self._ids([p.query for p in pairs], config.query_prefix)
        positives = self._ids([p.passage for p in pairs], config.passage_prefix)
        negatives = self._ids([n for i in indices for n in self.hard_negatives.get(i, [])]
                              if split == "train" and self.cfg.hard_negatives else [], config.passage_prefix)
        merge = resolve_merge_passes(self.cfg)
        if merge == "all":
            groups = [queries + positives + negatives]
        elif merge == "candidates":
            groups = [queries, positives + negatives]
        else:
            groups = [queries, positives] + ([negatives] if negatives else [])
        return {"passes": [self._cpu_collate(group) for group in groups],
                "counts": (len(queries), len(positives), len(negatives))}

    def _loader(self, split: str, epoch: int, shuffle: bool, hard_negatives: dict[int, list[str]]) -> DataLoader:
        """Batches of pair indices from our sampler, sharded to this rank (Lightning's is off)."""
        trainer = getattr(self, "trainer", None)
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        on_cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        lengths = self.lengths(split) if self.cfg.length_bucketing else None
        sampler = NoDuplicateBatchSampler(self.pairs[split], self.cfg.batch_size, seed=self.cfg.seed, shuffle=shuffle,
                                          hard_negatives=hard_negatives, num_replicas=world, rank=rank,
                                          lengths=lengths)
        sampler.set_epoch(epoch)
        return DataLoader(list(range(len(self.pairs[split]))), batch_sampler=sampler,
                          collate_fn=functools.partial(self.collate, split), num_workers=self.cfg.num_workers,
                          pin_memory=on_cuda)

    def mine(self) -> None:
        """Hard negatives for every training pair with the module's current weights."""
        if not self.cfg.hard_negatives:
            return
        encoder = self.encoder
        was_training = encoder.model.training
        encoder.model.eval()
        sync_encoder_device(encoder)
        try:
            self.hard_negatives = mine_hard_negatives(encoder, self.dataset, self.pairs["train"],
                                                      self.cfg.hard_negatives, self.cfg.hard_negative_skip)
        finally:
            encoder.model.train(was_training)

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        stale = not self.hard_negatives or (self.cfg.refresh_hard_negatives and self._mined_epoch != epoch)
        if self.cfg.hard_negatives and stale:  # once per epoch (Lightning may ask for the loader twice)
            self.mine()
            self._mined_epoch = epoch
        return self._loader("train", epoch, shuffle=True, hard_negatives=self.hard_negatives)

    def val_dataloader(self) -> DataLoader | list:
        if not self.pairs["val"]:
            return []
        return self._loader("val", 0, shuffle=False, hard_negatives={})
