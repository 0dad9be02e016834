"""Offline supervised contrastive pretraining of a retriever (RMM §8.6), with Lightning.

Pairs are (question, gold evidence turn as the bank stores it: "speaker: text"), split by user
(conversation) so no held-out conversation is ever seen in training. The loss is InfoNCE over
in-batch negatives (+ optional hard negatives mined with the current encoder), scored with the
encoder's own pooling and similarity, so the trained weights drop into the bank unchanged.

False negatives are kept out by the batch sampler rather than masked in the loss: a batch never
holds two pairs of the same question text, and no passage shown in a batch (positive or hard
negative) is gold for another query of that batch. Multi-GPU training gathers embeddings across
ranks so each query sees the global batch's passages (`loss`).

Modules, one concept each: `data` (pairs, split by user), `sampler` (false-negative-free batches,
sharded), `loss` (InfoNCE + cross-device gather), `mining` (hard negatives), `module` (the
LightningModule), `graphs` (its transformer passes replayed from CUDA graphs, `cuda_graphs: true`),
`datamodule` (the LightningDataModule), `evaluation` (held-out recall), `console` (Lightning's
screen output, one line per event) and `driver` (`run_pretrain`: the whole program, its one
resumable checkpoint and Ctrl-C).
"""

from __future__ import annotations

from rmm.training.pretrain.data import Pair, UserSplit, build_pairs, restrict, split_users, turn_texts
from rmm.training.pretrain.datamodule import PairDataModule
from rmm.training.pretrain.driver import PretrainInterrupted, PretrainReport, build, make_trainer, run_pretrain
from rmm.training.pretrain.evaluation import evaluate_heldout
from rmm.training.pretrain.loss import contrastive_logits, contrastive_loss, gather_embeddings
from rmm.training.pretrain.mining import mine_hard_negatives
from rmm.training.pretrain.module import ContrastiveModule
from rmm.training.pretrain.sampler import NoDuplicateBatchSampler
from rmm.training.pretrain_config import PretrainConfig, PretrainConfigError

__all__ = [
    "ContrastiveModule", "NoDuplicateBatchSampler", "Pair", "PairDataModule", "PretrainConfig",
    "PretrainConfigError", "PretrainInterrupted", "PretrainReport", "UserSplit", "build", "build_pairs",
    "contrastive_logits", "contrastive_loss", "evaluate_heldout", "gather_embeddings", "make_trainer",
    "mine_hard_negatives", "restrict", "run_pretrain", "split_users", "turn_texts",
]
