"""The driver: split → held-out recall before → fit → save the encoder → recall after (`run_pretrain`).

The encoder folder records whose conversations trained it (`rmm_pretraining.json`, read back as
`Encoder.pretrained_on`), so `rmm train` / `rmm eval` can refuse held-out figures on them.

What a run keeps for resuming is one file, `checkpoints/last.ckpt`, rewritten at the end of every
epoch: the weights, the AdamW moments, the LR schedule and Lightning's loop counters — everything
`resume_from=last` needs to continue exactly where the run stopped (≈ 3 × the weights in fp32, as
AdamW keeps two moments per weight). No "best val_loss" copy: the exported encoder is always the
last epoch's weights, so a second copy was never read. Ctrl-C ends the run with
`PretrainInterrupted`, which names that checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rmm.encoders import load_encoder
from rmm.encoders.encoder import Pretraining
from rmm.errors import ConfigError
from rmm.training.pretrain.console import lightning_console
from rmm.training.pretrain.data import UserSplit, split_users
from rmm.training.pretrain.datamodule import PairDataModule
from rmm.training.pretrain.evaluation import evaluate_heldout
from rmm.training.pretrain.module import ContrastiveModule, batch_pairs, resolve_precision
from rmm.training.pretrain_config import PretrainConfig, PretrainConfigError
from rmm.training.splits import refuse_pretrained_users
from rmm.types import Dataset

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "last"


class PretrainInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: says where the last checkpoint is and how to resume from it.

    A KeyboardInterrupt, so callers that treat any interrupt alike (exit 130) still do."""

    def __init__(self, checkpoint: Path | None) -> None:
        self.checkpoint = checkpoint
        if checkpoint is not None:
            message = f"interrupted — last checkpoint at {checkpoint} (resume with resume_from={checkpoint})"
        else:
            message = ("interrupted — no checkpoint yet (one is written at the end of every epoch when "
                       "checkpoint=true)")
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


def checkpoint_path(cfg: PretrainConfig) -> Path:
    """The one checkpoint a run keeps (see the module docstring)."""
    return Path(cfg.output_dir) / "checkpoints" / f"{CHECKPOINT_NAME}.ckpt"


def resume_path(cfg: PretrainConfig) -> Path | None:
    """The checkpoint `resume_from` names (`last` = this output_dir's), checked to exist."""
    if not cfg.resume_from:
        return None
    path = checkpoint_path(cfg) if cfg.resume_from == "last" else Path(cfg.resume_from).expanduser()
    if not path.is_file():
        raise ConfigError(f"resume_from: no checkpoint at {path}")
    return path


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


class _InterruptWatch(L.Callback):
    """Notes a KeyboardInterrupt inside `fit`: Lightning turns it into `sys.exit(1)` after its shutdown."""

    def __init__(self) -> None:
        self.interrupted = False

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.interrupted = self.interrupted or isinstance(exception, KeyboardInterrupt)


class _Throughput(L.Callback):
    """Pairs per second over training batches (excludes mining, validation and evaluation)."""

    def __init__(self) -> None:
        self.pairs, self.seconds, self.steps = 0, 0.0, 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seconds += time.perf_counter() - self._start
        self.pairs += batch_pairs(batch) * trainer.world_size
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
    refuse_pretrained_users(cfg.encoder, encoder.pretrained_on, dataset.name, split.test,
                            "pretrain it further with the split it was pretrained with (its seed and test_fraction)")
    module = ContrastiveModule(encoder, cfg)
    data = PairDataModule(dataset, encoder, cfg, split, module)
    return module, data


def pretraining_record(cfg: PretrainConfig, dataset: str, split: UserSplit) -> Pretraining:
    """What the encoder folder records of this run: the users it trained on, and those it held out
    (with the seed and fraction that chose them: `rmm train --heldout F --seed S` holds out the same)."""
    return Pretraining(dataset=dataset, users=tuple(split.train), heldout=tuple(split.test),
                       validation=tuple(split.val), seed=cfg.seed, heldout_fraction=cfg.test_fraction)


def _progress_bar(cfg: PretrainConfig) -> L.Callback:
    """Lightning's bar, redrawn every step on CPU (steps take seconds) but every 10th on a GPU: each
    redraw reads the logged loss, a device sync that would stop the CPU from queueing the next step."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    refresh = 1 if cfg.accelerator == "cpu" or not _cuda_available() else 10
    return RichProgressBar(refresh_rate=refresh) if _RICH_AVAILABLE else TQDMProgressBar(refresh_rate=refresh)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def make_trainer(cfg: PretrainConfig, callbacks: list[Any] | None = None) -> L.Trainer:
    callbacks = list(callbacks or [])
    if cfg.progress:
        callbacks.append(_progress_bar(cfg))
    if cfg.checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        # monitor=None + top-1 + a fixed name: one file, rewritten each epoch (never "-v1" copies)
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_path(cfg).parent, filename=CHECKPOINT_NAME,
                                         monitor=None, save_top_k=1, save_last=False,
                                         enable_version_counter=False))
    return L.Trainer(
        max_epochs=cfg.epochs, max_steps=cfg.max_steps, accelerator=cfg.accelerator, devices=cfg.devices,
        strategy=cfg.strategy, precision=resolve_precision(cfg), gradient_clip_val=cfg.grad_clip or None,
        use_distributed_sampler=False,  # NoDuplicateBatchSampler shards itself
        reload_dataloaders_every_n_epochs=1 if cfg.hard_negatives and cfg.refresh_hard_negatives else 0,
        logger=_wandb_logger(cfg), callbacks=callbacks, enable_checkpointing=cfg.checkpoint,
        log_every_n_steps=cfg.log_every_n_steps, enable_progress_bar=cfg.progress, num_sanity_val_steps=0,
        limit_val_batches=None if cfg.val_fraction > 0 else 0,  # no validation users: no loop, no warning
        # a one-epoch run capped by max_steps: the progress bar's total (and ETA) is the cap, not the epoch
        limit_train_batches=cfg.max_steps if cfg.max_steps > 0 and cfg.epochs == 1 else None,
        default_root_dir=cfg.output_dir, enable_model_summary=False,
    )


def _recall_line(label: str, figures: dict[str, Any], ks: list[int]) -> str:
    recalls = ", ".join(f"recall@{k} {figures[f'recall@{k}']:.3f}" for k in ks if f"recall@{k}" in figures)
    return f"held-out {label}: {recalls} ({figures.get('n', '?')} questions)"


def _launching_rank() -> bool:
    """Under DDP every rank runs `run_pretrain`; only the launching one (LOCAL_RANK/NODE_RANK 0) evaluates."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def _fit(trainer: L.Trainer, module: ContrastiveModule, data: PairDataModule, cfg: PretrainConfig,
         watch: _InterruptWatch) -> None:
    """`trainer.fit`, with Ctrl-C surfacing as a KeyboardInterrupt rather than Lightning's `sys.exit(1)`
    (Lightning also leaves SIGINT ignored after its shutdown: the handler is put back here)."""
    main_thread = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    resume = resume_path(cfg)
    try:
        with warnings.catch_warnings():
            if resume is not None:  # resuming into the run's own folder is the point, not a mistake
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            trainer.fit(module, datamodule=data, ckpt_path=resume)
    except SystemExit:
        if not watch.interrupted:
            raise
        raise KeyboardInterrupt from None
    finally:
        if main_thread and sigint is not None:
            signal.signal(signal.SIGINT, sigint)


def run_pretrain(config: PretrainConfig, dataset: Dataset | None = None,
                 callbacks: Sequence[L.Callback] = ()) -> PretrainReport:
    """The whole program: split → (held-out recall before) → fit → save encoder → recall after.

    `callbacks` are extra Lightning callbacks for the fit. Ctrl-C anywhere raises
    `PretrainInterrupted` naming the last checkpoint."""
    try:
        with lightning_console():
            return _run(config, dataset, list(callbacks))
    except PretrainInterrupted:
        raise
    except KeyboardInterrupt:
        last = checkpoint_path(config)
        raise PretrainInterrupted(last if config.checkpoint and last.is_file() else None) from None


def _run(cfg: PretrainConfig, dataset: Dataset | None, callbacks: list[L.Callback]) -> PretrainReport:
    output = Path(cfg.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    resume_path(cfg)  # a missing checkpoint is refused before any work
    if cfg.cuda_graphs and not torch.cuda.is_available():  # refused before the held-out evaluation, not after
        raise PretrainConfigError("cuda_graphs: true needs a CUDA device, and torch sees none here")
    module, data = build(cfg, dataset)
    log.info("pairs: train %d, val %d, test %d", *(len(data.pairs[s]) for s in ("train", "val", "test")))
    scratch = Path(tempfile.mkdtemp(prefix="eval-banks-", dir=output))
    try:
        rerank = cfg if cfg.rerank else None
        before: dict[str, Any] = {}
        rerank_before: dict[str, Any] = {}
        if cfg.eval_before and _launching_rank():
            module.model.eval()
            before, rerank_before = evaluate_heldout(module.encoder, data.dataset, data.split.test, cfg.eval_ks,
                                                     scratch / "before", train_users=data.split.train, rerank=rerank,
                                                     progress=cfg.progress)
            log.info("%s", _recall_line("recall before pretraining", before, cfg.eval_ks))
        module.train()  # Lightning 2.6 keeps the modes it finds; the encoder was loaded for inference
        throughput = _Throughput()
        watch = _InterruptWatch()
        trainer = make_trainer(cfg, [throughput, watch, *callbacks])
        log.info("training %s on %s (%s precision%s): %d epoch(s)%s, batch %d", cfg.encoder,
                 trainer.strategy.root_device, trainer.precision,
                 ", torch.compile" if cfg.torch_compile else ", CUDA graphs" if cfg.cuda_graphs else "",
                 cfg.epochs, f", at most {cfg.max_steps} steps" if cfg.max_steps > 0 else "", cfg.batch_size)
        started = time.perf_counter()
        _fit(trainer, module, data, cfg, watch)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.global_rank != 0:
            return PretrainReport(module.encoder.name, "", data.split.describe(), {}, throughput.steps, 0.0, 0.0,
                                  rank=trainer.global_rank)
        log.info("trained %d steps in %.0f s (%.1f pairs/s in training steps)%s", throughput.steps,
                 time.perf_counter() - started, throughput.pairs / throughput.seconds if throughput.seconds else 0.0,
                 f"; checkpoint {checkpoint_path(cfg)}" if cfg.checkpoint else "")
        module.model.eval()
        module.encoder.config.name = f"{module.encoder.config.name}-pretrained"
        module.encoder.name = module.encoder.config.name
        module.encoder.pretrained_on = pretraining_record(cfg, data.dataset.name, data.split).merged(
            module.encoder.pretrained_on)
        encoder_dir = module.export_encoder(output / "encoder")
        log.info("pretrained encoder written to %s", encoder_dir)
        trained = load_encoder(str(encoder_dir), device=cfg.eval_device)
        after, rerank_after = evaluate_heldout(trained, data.dataset, data.split.test, cfg.eval_ks, scratch / "after",
                                               train_users=data.split.train, rerank=rerank, progress=cfg.progress)
        log.info("%s", _recall_line("recall after pretraining", after, cfg.eval_ks))
        report = PretrainReport(
            encoder=cfg.encoder, output=str(encoder_dir), split=data.split.describe(),
            n_pairs={s: len(p) for s, p in data.pairs.items()}, steps=throughput.steps, seconds=throughput.seconds,
            pairs_per_second=throughput.pairs / throughput.seconds if throughput.seconds else 0.0,
            before=before, after=after, rerank_before=rerank_before, rerank_after=rerank_after,
            final_train_loss=metrics.get("train_loss"), final_val_loss=metrics.get("val_loss"), config=cfg.to_dict(),
        )
        (output / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
