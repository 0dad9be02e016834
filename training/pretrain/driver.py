"""The driver: split → held-out recall before → fit → save the encoder → recall after (`run_pretrain`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L

from rmm.encoders import load_encoder
from rmm.training.pretrain.data import split_users
from rmm.training.pretrain.datamodule import PairDataModule
from rmm.training.pretrain.evaluation import evaluate_heldout
from rmm.training.pretrain.module import ContrastiveModule, resolve_precision
from rmm.training.pretrain_config import PretrainConfig
from rmm.types import Dataset

log = logging.getLogger(__name__)


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


def _wandb_logger(cfg: PretrainConfig) -> Any:
    if not cfg.wandb_project or os.environ.get("WANDB_MODE", "").lower() == "disabled":
        return False
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project=cfg.wandb_project, name=cfg.wandb_run_name, save_dir=cfg.output_dir,
                       config=cfg.to_dict())


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
        strategy=cfg.strategy, precision=resolve_precision(cfg), gradient_clip_val=cfg.grad_clip or None,
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
    trained = load_encoder(str(encoder_dir), device=cfg.eval_device)
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
    shutil.rmtree(scratch, ignore_errors=True)
    return report
