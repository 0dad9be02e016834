"""The LightningModule: the encoder's transformer (+ dense head) trained with InfoNCE.

Pooling and normalisation are the encoder's own (`Encoder.embed`), so the trained weights drop into
the bank unchanged; `export_encoder` writes a folder `load_encoder` reads (LoRA merged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from rmm.encoders import Encoder
from rmm.errors import RmmError
from rmm.training.pretrain.graphs import GraphedPasses
from rmm.training.pretrain.loss import contrastive_loss
from rmm.training.pretrain_config import PretrainConfig

MAX_LOGIT_SCALE = 100.0


def _trains_on_cuda(cfg: PretrainConfig) -> bool:
    """Where an `auto` setting resolves: Lightning will train on a CUDA device."""
    return torch.cuda.is_available() and cfg.accelerator in ("auto", "gpu", "cuda")


def resolve_precision(cfg: PretrainConfig) -> str:
    """`auto` → bf16-mixed where CUDA trains, 32-true on CPU (the trainer and the optimiser agree)."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-mixed" if _trains_on_cuda(cfg) else "32-true"


def resolve_merge_passes(cfg: PretrainConfig) -> str:
    """`auto` → candidates where CUDA trains (launches bound the step), none elsewhere (padding does)."""
    if cfg.merge_passes != "auto":
        return cfg.merge_passes
    return "candidates" if _trains_on_cuda(cfg) else "none"


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


def sync_encoder_device(encoder: Encoder) -> None:
    """Encoder.collate sends inputs to `encoder.device`: keep it where Lightning put the weights."""
    encoder.device = next(encoder.model.parameters()).device


def batch_pairs(batch: dict[str, Any]) -> int:
    """(query, positive) pairs in a `PairDataModule` batch."""
    return int(batch["counts"][0])


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
        self.graphed: GraphedPasses | None = None  # `cuda_graphs`: set up once the weights are on the GPU

    @property
    def scale(self) -> Tensor:
        return self.log_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def embed(self, inputs: dict[str, Tensor]) -> Tensor:
        return self.encoder.embed(inputs)

    def on_fit_start(self) -> None:
        """`torch_compile`: compile the transformer in place (`nn.Module.compile`, so parameter names,
        checkpoints and the exported folder stay the same), with dynamic shapes since batches are
        padded to their own longest text."""
        if self.cfg.torch_compile and getattr(self.model, "_compiled_call_impl", None) is None:
            self.model.compile(dynamic=True)
        if self.cfg.cuda_graphs and self.graphed is None:
            if self.trainer.world_size > 1:
                raise RmmError("cuda_graphs: true trains on one device (graphs and DDP's gradient hooks do not mix)")
            if self.device.type != "cuda":
                raise RmmError(f"cuda_graphs: true needs the model on a CUDA device, not {self.device}")
            precision = resolve_precision(self.cfg)
            self.graphed = GraphedPasses(self.encoder, torch.bfloat16 if precision == "bf16-mixed" else None)

    def teardown(self, stage: str) -> None:
        """Graphs belong to one fit: Lightning moves the weights to the CPU after it, so a graph
        captured over their GPU addresses would replay over freed memory in the next fit."""
        self.graphed = None

    def batch_loss(self, batch: dict[str, Any]) -> Tensor:
        """InfoNCE of a `PairDataModule` batch: its passes embedded, then split into queries,
        positives and hard negatives by the batch's counts."""
        graphed = self.graphed if self.graphed is not None and self.training and torch.is_grad_enabled() else None
        embeddings = [graphed(position, inputs) if graphed is not None else self.embed(inputs)
                      for position, inputs in enumerate(batch["passes"])]
        rows = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings)
        queries, positives, negatives = rows.split(list(batch["counts"]))
        return contrastive_loss(queries, positives, negatives if len(negatives) else None, self.scale)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        size = batch_pairs(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=size)
        if self.cfg.learnable_temperature:
            self.log("temperature", 1.0 / self.scale.detach(), batch_size=size)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        size = batch_pairs(batch)
        self.log("val_loss", self.batch_loss(batch), prog_bar=True, batch_size=size, sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, parameter in self.named_parameters():
            if not parameter.requires_grad:
                continue
            (no_decay if parameter.dim() < 2 or name == "log_scale" else decay).append(parameter)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = self.cfg.fused_adamw and _fused_adamw_supported(decay + no_decay, resolve_precision(self.cfg))
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
        lightning_path = gradient_clip_algorithm not in (None, "norm") or resolve_precision(self.cfg) == "16-mixed"
        if not gradient_clip_val or lightning_path:
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
