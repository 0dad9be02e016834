"""Offline supervised contrastive pretraining of a retriever (RMM §8.6), with Lightning.

Pairs are (question, gold evidence turn as the bank stores it: "speaker: text"), split by user
(conversation) so no held-out conversation is ever seen in training. The loss is InfoNCE over
in-batch negatives (+ optional hard negatives mined with the current encoder), scored with the
encoder's own pooling and similarity, so the trained weights drop into the bank unchanged.

False negatives are kept out by the batch sampler rather than masked in the loss: a batch never
holds two pairs of the same question text, and no passage shown in a batch (positive or hard
negative) is gold for another query of that batch.

Multi-GPU: each rank embeds its shard, embeddings are all-gathered with a differentiable gather
(its backward sums the gradients of every rank's loss into the shard that produced them), each
rank's loss is the mean over its own queries against all gathered passages, and DDP averages the
parameter gradients over ranks — which together is exactly the gradient of the mean loss over the
global batch (see `contrastive_loss` and its fake-world test).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rmm.training.pretrain_config import PretrainConfig, PretrainConfigError
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rmm.encoders import Encoder, load_encoder
from rmm.errors import DataError, RmmError
from rmm.types import Dataset

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = 100.0


# ----------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Pair:
    """One training example: a question and one of its gold turns (texts as the bank holds them)."""

    query: str
    passage: str
    user: str
    question_id: str
    passage_id: str
    gold_passages: frozenset[str]  # texts of all the question's gold turns (never its negatives)


@dataclass
class UserSplit:
    train: list[str]
    val: list[str]
    test: list[str]

    def describe(self) -> str:
        return (f"split by user: train {len(self.train)} ({', '.join(self.train)}); val {len(self.val)} "
                f"({', '.join(self.val) or '-'}); test {len(self.test)} ({', '.join(self.test)})")


def split_users(users: Sequence[str], val_fraction: float, test_fraction: float, seed: int) -> UserSplit:
    """Seeded split of whole users (conversations): at least one user trains and one is tested."""
    users = list(users)
    if len(users) < 2:
        raise DataError(f"pretraining needs ≥ 2 users (conversations) to hold one out, got {len(users)}")
    shuffled = users[:]
    random.Random(seed).shuffle(shuffled)
    n_test = min(len(users) - 1, max(1, round(len(users) * test_fraction)))
    n_val = min(len(users) - 1 - n_test, round(len(users) * val_fraction))
    if val_fraction > 0 and n_val == 0 and len(users) - n_test >= 2:
        n_val = 1
    test, val, train = shuffled[:n_test], shuffled[n_test:n_test + n_val], shuffled[n_test + n_val:]
    order = {u: i for i, u in enumerate(users)}
    return UserSplit(sorted(train, key=order.get), sorted(val, key=order.get), sorted(test, key=order.get))


def turn_texts(dataset: Dataset, user: str) -> dict[str, str]:
    """Turn id → the text the turn bank embeds (`rmm.eval.benchmark_bank.documents`, turn granularity)."""
    from rmm.eval.benchmark_bank import documents

    return {m.id: m.text for m in documents(dataset, user, "turn")}


def build_pairs(dataset: Dataset, users: Sequence[str]) -> list[Pair]:
    """One pair per (question, gold turn) of the given users; questions without gold turns skipped."""
    wanted = set(users)
    texts = {u: turn_texts(dataset, u) for u in users}
    pairs: list[Pair] = []
    for q in dataset.questions:
        if q.user_id not in wanted or q.abstention:
            continue
        gold = [t for t in dict.fromkeys(q.evidence_turns) if t in texts[q.user_id]]
        gold_texts = frozenset(texts[q.user_id][t] for t in gold)
        for turn_id in gold:
            pairs.append(Pair(q.text, texts[q.user_id][turn_id], q.user_id, q.id, turn_id, gold_texts))
    return pairs


def restrict(dataset: Dataset, users: Sequence[str]) -> Dataset:
    """The dataset limited to some users and their questions (keeps its name: same reporting rules)."""
    keep = set(users)
    return Dataset(name=dataset.name, sessions={u: s for u, s in dataset.sessions.items() if u in keep},
                   questions=[q for q in dataset.questions if q.user_id in keep], categories=dataset.categories)


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
    """

    def __init__(self, pairs: Sequence[Pair], batch_size: int, seed: int = 0, shuffle: bool = True,
                 hard_negatives: dict[int, list[str]] | None = None, num_replicas: int = 1, rank: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.pairs, self.batch_size, self.seed, self.shuffle = pairs, batch_size, seed, shuffle
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


# ----------------------------------------------------------------------------------- loss


def gather_embeddings(tensor: Tensor) -> tuple[Tensor, int]:
    """All ranks' rows concatenated in rank order, and this rank's index.

    The gather is differentiable (`torch.distributed.nn.functional.all_gather`): its backward
    sums, into each rank's shard, the gradients that every rank's loss sends to that shard.
    Single process: the tensor itself, rank 0.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor, 0
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous()), dim=0), dist.get_rank()


def contrastive_logits(queries: Tensor, positives_all: Tensor, negatives_all: Tensor | None, rank: int,
                       scale: Tensor | float) -> tuple[Tensor, Tensor]:
    """Logits of this rank's queries [B, d] against every gathered passage, and their labels.

    Columns: all ranks' positives (rank-major, B each) then all ranks' hard negatives; query i of
    rank r has its positive at column r·B + i.
    """
    columns = positives_all if negatives_all is None or negatives_all.numel() == 0 else torch.cat(
        [positives_all, negatives_all], dim=0)
    logits = (queries @ columns.T) * scale
    labels = torch.arange(queries.shape[0], device=queries.device) + rank * queries.shape[0]
    return logits, labels


def contrastive_loss(queries: Tensor, positives: Tensor, negatives: Tensor | None,
                     scale: Tensor | float) -> Tensor:
    """InfoNCE of this rank's queries; mean over its queries (DDP's gradient averaging completes
    the global mean — no rescaling by the world size, since the gather's backward sums)."""
    positives_all, rank = gather_embeddings(positives)
    negatives_all = gather_embeddings(negatives)[0] if negatives is not None and negatives.numel() else None
    logits, labels = contrastive_logits(queries, positives_all, negatives_all, rank, scale)
    return nn.functional.cross_entropy(logits.float(), labels)


# ----------------------------------------------------------------------------------- module


def _lora_wrap(model: nn.Module, cfg: PretrainConfig) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise RmmError("lora=true needs the `peft` package: `pip install peft` (or `pip install rmm[train]`)") from err
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=cfg.lora_target_modules, bias="none")
    wrapped = get_peft_model(model, config)
    wrapped.print_trainable_parameters()
    return wrapped


def _fused_adamw_supported(parameters: Sequence[Tensor], precision: str) -> bool:
    """AdamW's fused kernel (one pass over all tensors: ~6x faster than the default multi-tensor
    step on CPU, 0.1 s instead of 0.6 s per MiniLM step) where torch has it. Not under 16-mixed:
    a fused AdamW unscales the gradients itself, and Lightning then refuses gradient clipping."""
    return (precision != "16-mixed" and bool(parameters)
            and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in parameters))


def _freeze_unused_heads(model: nn.Module) -> None:
    """Freeze heads `Encoder.embed` never reads (BERT's `pooler`: embed pools last_hidden_state).

    Trainable parameters without a gradient make DDP fail on its second step ("parameters that were
    not used in producing the loss"), and AdamW would decay them for nothing."""
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)


def _sync_encoder_device(encoder: Encoder) -> None:
    """Encoder.collate sends inputs to `encoder.device`: keep it where Lightning put the weights."""
    encoder.device = next(encoder.model.parameters()).device


class ContrastiveModule(L.LightningModule):
    """The encoder's transformer (+ dense head) trained with InfoNCE; pooling/normalisation are the
    encoder's own (`Encoder.embed`)."""

    def __init__(self, encoder: Encoder, cfg: PretrainConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder  # not an nn.Module: its parts are registered below
        self.model = encoder.model
        self.dense = encoder.dense
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora:
            self.model = _lora_wrap(self.model, cfg)
            encoder.model = self.model
        else:
            self.model.requires_grad_(True)  # Encoder loads frozen for inference
            _freeze_unused_heads(self.model)
        if self.dense is not None:
            self.dense.requires_grad_(True)
        init = math.log(1.0 / cfg.temperature)
        self.log_scale = nn.Parameter(torch.tensor(init), requires_grad=cfg.learnable_temperature)

    @property
    def scale(self) -> Tensor:
        return self.log_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def embed(self, inputs: dict[str, Tensor]) -> Tensor:
        return self.encoder.embed(inputs)

    def batch_loss(self, batch: dict[str, Any]) -> Tensor:
        queries = self.embed(batch["queries"])
        positives = self.embed(batch["positives"])
        negatives = self.embed(batch["negatives"]) if batch.get("negatives") is not None else None
        return contrastive_loss(queries, positives, negatives, self.scale)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        size = batch["queries"]["input_ids"].shape[0]
        self.log("train_loss", loss, prog_bar=True, batch_size=size)
        if self.cfg.learnable_temperature:
            self.log("temperature", 1.0 / self.scale.detach(), batch_size=size)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        size = batch["queries"]["input_ids"].shape[0]
        self.log("val_loss", self.batch_loss(batch), prog_bar=True, batch_size=size, sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, parameter in self.named_parameters():
            if not parameter.requires_grad:
                continue
            (no_decay if parameter.dim() < 2 or name == "log_scale" else decay).append(parameter)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = self.cfg.fused_adamw and _fused_adamw_supported(decay + no_decay, _precision(self.cfg))
        optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, **({"fused": True} if fused else {}))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(total * self.cfg.warmup_ratio)

        def schedule(step: int) -> float:  # linear warm-up, then linear decay to 0
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Norm clipping with the multi-tensor kernel: torch picks it by default only for CUDA
        tensors, and on CPU the per-tensor loop costs about twice as long (~0.1 s per MiniLM step)."""
        if not gradient_clip_val or gradient_clip_algorithm not in (None, "norm") or _precision(self.cfg) == "16-mixed":
            # value clipping, or a GradScaler whose checks Lightning's own path keeps
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if parameters:
            nn.utils.clip_grad_norm_(parameters, gradient_clip_val, foreach=True)

    def export_encoder(self, folder: str | Path) -> Path:
        """Write an encoder folder `load_encoder` reads (LoRA merged into the weights)."""
        encoder = self.encoder
        model = self.model
        if self.cfg.lora:
            model = model.merge_and_unload()
        if self.cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_disable"):
            model.gradient_checkpointing_disable()
        original = encoder.model
        encoder.model = model
        try:
            return encoder.save(folder)
        finally:
            encoder.model = original


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
        device = self.encoder.device
        self.encoder.device = torch.device("cpu")  # Lightning moves the batch to the model's device
        try:
            return self.encoder.collate(sequences)
        finally:
            self.encoder.device = device

    def collate(self, split: str, indices: list[int]) -> dict[str, Any]:
        pairs = [self.pairs[split][i] for i in indices]
        config = self.encoder.config
        batch: dict[str, Any] = {
            "queries": self._cpu_collate(self._ids([p.query for p in pairs], config.query_prefix)),
            "positives": self._cpu_collate(self._ids([p.passage for p in pairs], config.passage_prefix)),
            "negatives": None,
        }
        if split == "train" and self.cfg.hard_negatives:
            negatives = [n for i in indices for n in self.hard_negatives.get(i, [])]
            if negatives:
                batch["negatives"] = self._cpu_collate(self._ids(negatives, config.passage_prefix))
        return batch

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def mine(self) -> None:
        """Hard negatives for every training pair with the module's current weights."""
        if not self.cfg.hard_negatives:
            return
        encoder = self.encoder
        was_training = encoder.model.training
        encoder.model.eval()
        _sync_encoder_device(encoder)
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
        world, rank = self._world()
        sampler = NoDuplicateBatchSampler(self.pairs["train"], self.cfg.batch_size, seed=self.cfg.seed,
                                          hard_negatives=self.hard_negatives, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        return DataLoader(list(range(len(self.pairs["train"]))), batch_sampler=sampler,
                          collate_fn=lambda idx: self.collate("train", idx), num_workers=self.cfg.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if not self.pairs["val"]:
            return []
        world, rank = self._world()
        sampler = NoDuplicateBatchSampler(self.pairs["val"], self.cfg.batch_size, seed=self.cfg.seed,
                                          shuffle=False, num_replicas=world, rank=rank)
        return DataLoader(list(range(len(self.pairs["val"]))), batch_sampler=sampler,
                          collate_fn=lambda idx: self.collate("val", idx), num_workers=self.cfg.num_workers)


def mine_hard_negatives(encoder: Encoder, dataset: Dataset, pairs: Sequence[Pair], k: int,
                        skip: int = 0) -> dict[int, list[str]]:
    """Pair index → texts of the top-ranked turns of the same user that are not gold for its question."""
    by_user: dict[str, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        by_user[pair.user].append(i)
    negatives: dict[int, list[str]] = {}
    for user, indices in by_user.items():
        turns = list(dict.fromkeys(turn_texts(dataset, user).values()))
        passages = encoder.encode_passages(turns)
        questions = list(dict.fromkeys(pairs[i].query for i in indices))
        scores = encoder.encode_queries(questions) @ passages.T
        ranked = {q: scores[row].argsort(descending=True).tolist() for row, q in enumerate(questions)}
        for i in indices:
            gold = pairs[i].gold_passages
            candidates = [turns[j] for j in ranked[pairs[i].query] if turns[j] not in gold]
            negatives[i] = candidates[skip:skip + k]
    return negatives


# ----------------------------------------------------------------------------------- run


@dataclass
class PretrainReport:
    encoder: str
    output: str
    split: str
    n_pairs: dict[str, int]
    steps: int
    seconds: float
    pairs_per_second: float
    before: dict[str, Any] = field(default_factory=dict)  # held-out recall, base encoder
    after: dict[str, Any] = field(default_factory=dict)  # held-out recall, pretrained encoder
    rerank_before: dict[str, Any] = field(default_factory=dict)  # base encoder + online reranker
    rerank_after: dict[str, Any] = field(default_factory=dict)  # "pretraining + RR"
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # under DDP, only rank 0's report holds results; the others are placeholders

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _precision(cfg: PretrainConfig) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-mixed" if torch.cuda.is_available() and cfg.accelerator in ("auto", "gpu", "cuda") else "32-true"


def _wandb_logger(cfg: PretrainConfig) -> Any:
    if not cfg.wandb_project or os.environ.get("WANDB_MODE", "").lower() == "disabled":
        return False
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project=cfg.wandb_project, name=cfg.wandb_run_name, save_dir=cfg.output_dir,
                       config=cfg.to_dict())


def evaluate_heldout(encoder: Encoder, dataset: Dataset, users: Sequence[str], ks: Sequence[int],
                     bank_dir: Path, *, train_users: Sequence[str] = (), rerank: PretrainConfig | None = None,
                     progress: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Recall@ks of `encoder` on the held-out users' questions (bank of those users only, plus the
    training users when the online reranker is trained on top), and, with `rerank`, the reranker's
    held-out recall after online training on the training users' questions."""
    from rmm.eval.benchmark_bank import fill
    from rmm.eval.retrieval import evaluate
    from rmm.memory.bank import MemoryBank

    _sync_encoder_device(encoder)
    bank_users = list(users) + ([u for u in train_users if u not in users] if rerank else [])
    subset = restrict(dataset, bank_users)
    test = restrict(dataset, users)
    with MemoryBank(bank_dir, encoder, device=str(encoder.device)) as bank:
        fill(bank, subset, "turn", progress=progress)
        report = evaluate(test, bank, "turn", ks, retriever_name=encoder.name, progress=progress)
        retrieval = {**report.overall, "by_category": report.by_category}
        reranked: dict[str, Any] = {}
        if rerank is not None:
            reranked = _online_rerank(subset, bank, list(train_users), list(users), rerank, progress)
    return retrieval, reranked


def _online_rerank(dataset: Dataset, bank: Any, train_users: list[str], test_users: list[str],
                   cfg: PretrainConfig, progress: bool) -> dict[str, Any]:
    from rmm.training.online import OnlineConfig, OnlineTrainer, Split

    from rmm.eval.retrieval import GoldScorer, scorable
    from rmm.policy.learner import recipe_for

    recipe = recipe_for(cfg.rerank_recipe, bank.encoder.config.normalize)
    online = OnlineConfig(**recipe, epochs=cfg.rerank_epochs, seed=cfg.seed)
    trainer = OnlineTrainer(dataset, bank, online, progress=progress)
    questions = scorable(dataset.questions, GoldScorer.for_dataset(dataset, "turn"))
    train = [q for q in questions if q.user_id in set(train_users)]
    held = [q for q in questions if q.user_id in set(test_users)]
    # the pretraining split, not the online trainer's own: held-out conversations stay unseen by both
    trainer.split = Split(train, held, train_users, test_users,
                          f"pretraining split: reranker trains on {len(train)} questions, held out {len(held)}")
    report = trainer.run()
    return {"retriever_heldout": report.retriever_heldout, "reranker_heldout": report.reranker_heldout,
            "recipe": recipe["recipe"], "eval_k": online.eval_k}


class _Throughput(L.Callback):
    """Pairs per second over training batches (excludes mining, validation and evaluation)."""

    def __init__(self) -> None:
        self.pairs, self.seconds, self.steps = 0, 0.0, 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seconds += time.perf_counter() - self._start
        self.pairs += int(batch["queries"]["input_ids"].shape[0]) * trainer.world_size
        self.steps += 1


def build(cfg: PretrainConfig, dataset: Dataset | None = None) -> tuple[ContrastiveModule, PairDataModule]:
    """Load data and encoder, split by user (logged), and build the module and data module."""
    from rmm.data import load_dataset

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if dataset is None:
        dataset = load_dataset(cfg.dataset, cfg.data_dir)
    split = split_users([u for u in dataset.users if dataset.questions_of(u)], cfg.val_fraction,
                        cfg.test_fraction, cfg.seed)
    log.info("%s", split.describe())
    encoder = load_encoder(cfg.encoder, device="cpu", dtype=cfg.dtype, onednn=True)
    module = ContrastiveModule(encoder, cfg)
    data = PairDataModule(dataset, encoder, cfg, split, module)
    return module, data


def make_trainer(cfg: PretrainConfig, callbacks: list[Any] | None = None) -> L.Trainer:
    callbacks = list(callbacks or [])
    if cfg.checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=Path(cfg.output_dir) / "checkpoints", save_last=True,
                                         save_top_k=1 if cfg.val_fraction > 0 else 0,
                                         monitor="val_loss" if cfg.val_fraction > 0 else None))
    return L.Trainer(
        max_epochs=cfg.epochs, max_steps=cfg.max_steps, accelerator=cfg.accelerator, devices=cfg.devices,
        strategy=cfg.strategy, precision=_precision(cfg), gradient_clip_val=cfg.grad_clip or None,
        use_distributed_sampler=False,  # NoDuplicateBatchSampler shards itself
        reload_dataloaders_every_n_epochs=1 if cfg.hard_negatives and cfg.refresh_hard_negatives else 0,
        logger=_wandb_logger(cfg), callbacks=callbacks, enable_checkpointing=cfg.checkpoint,
        log_every_n_steps=cfg.log_every_n_steps, enable_progress_bar=cfg.progress, num_sanity_val_steps=0,
        default_root_dir=cfg.output_dir, enable_model_summary=False,
    )


def run_pretrain(config: PretrainConfig, dataset: Dataset | None = None) -> PretrainReport:
    """The whole program: split → (held-out recall before) → fit → save encoder → recall after."""
    cfg = config
    output = Path(cfg.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    module, data = build(cfg, dataset)
    log.info("pairs: train %d, val %d, test %d", *(len(data.pairs[s]) for s in ("train", "val", "test")))
    scratch = Path(tempfile.mkdtemp(prefix="eval-banks-", dir=output))
    rerank = cfg if cfg.rerank else None
    before: dict[str, Any] = {}
    rerank_before: dict[str, Any] = {}
    # under DDP every rank runs this function; only the launching rank (LOCAL_RANK unset/0) evaluates
    if cfg.eval_before and int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
        module.model.eval()
        before, rerank_before = evaluate_heldout(module.encoder, data.dataset, data.split.test, cfg.eval_ks,
                                                 scratch / "before", train_users=data.split.train, rerank=rerank,
                                                 progress=cfg.progress)
    module.train()  # Lightning 2.6 keeps the modes it finds; the encoder was loaded for inference
    throughput = _Throughput()
    trainer = make_trainer(cfg, [throughput])
    trainer.fit(module, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_rank != 0:
        return PretrainReport(module.encoder.name, "", data.split.describe(), {}, throughput.steps, 0.0, 0.0,
                              rank=trainer.global_rank)
    module.model.eval()
    module.encoder.config.name = f"{module.encoder.config.name}-pretrained"
    module.encoder.name = module.encoder.config.name
    encoder_dir = module.export_encoder(output / "encoder")
    log.info("pretrained encoder written to %s", encoder_dir)
    from rmm.encoders import load_encoder as _load

    trained = _load(str(encoder_dir), device=cfg.eval_device)
    after, rerank_after = evaluate_heldout(trained, data.dataset, data.split.test, cfg.eval_ks, scratch / "after",
                                           train_users=data.split.train, rerank=rerank, progress=cfg.progress)
    report = PretrainReport(
        encoder=cfg.encoder, output=str(encoder_dir), split=data.split.describe(),
        n_pairs={s: len(p) for s, p in data.pairs.items()}, steps=throughput.steps, seconds=throughput.seconds,
        pairs_per_second=throughput.pairs / throughput.seconds if throughput.seconds else 0.0,
        before=before, after=after, rerank_before=rerank_before, rerank_after=rerank_after,
        final_train_loss=metrics.get("train_loss"), final_val_loss=metrics.get("val_loss"), config=cfg.to_dict(),
    )
    (output / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    return report


__all__ = [
    "ContrastiveModule", "NoDuplicateBatchSampler", "Pair", "PairDataModule", "PretrainConfig",
    "PretrainConfigError", "PretrainReport", "UserSplit", "build", "build_pairs", "contrastive_logits",
    "contrastive_loss", "evaluate_heldout", "gather_embeddings", "mine_hard_negatives", "restrict", "run_pretrain",
    "split_users",
]

