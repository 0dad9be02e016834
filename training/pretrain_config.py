"""Configuration of offline contrastive pretraining: one dataclass, read from YAML, `key=value` overrides.

A recipe is a YAML file of `PretrainConfig` fields; the command line may override any field with
`key=value` (the value is parsed as YAML, so `epochs=2`, `lora=true`, `lora_target_modules=[q,v]`
work). Loading, typing and the refusal of unknown keys are `rmm.config`'s, shared by every command;
this module holds the fields and the checks that only make sense for pretraining.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmm import config as _config
from rmm.errors import ConfigError

# One error type for every config; the old name stays importable.
PretrainConfigError = ConfigError

MERGE_PASSES = ("auto", "none", "candidates", "all")


@dataclass
class PretrainConfig:
    """Every knob of a pretraining run (RMM §8.6 / App. A.1: lr 1e-4, 10 epochs, batch 32)."""

    # what to train, on what
    encoder: str = "minilm"  # preset name or encoder folder (load_encoder)
    dataset: str = "locomo"  # rmm.data.load_dataset name
    data_dir: str | None = None
    output_dir: str = "runs/pretrain"
    seed: int = 0
    # split by conversation/user (fractions of users; at least one user in train and test)
    val_fraction: float = 0.1
    test_fraction: float = 0.3
    # optimisation
    epochs: int = 10
    max_steps: int = -1  # > 0 stops earlier (tests, benchmarks)
    batch_size: int = 32  # pairs per device; the global batch is batch_size × world size
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    max_length: int = 128  # training truncation (the saved encoder keeps its own max_length)
    # InfoNCE: scores are the encoder's own similarity (dot product of its output, i.e. cosine for
    # L2-normalised encoders) divided by the temperature; learnable → a log-scale parameter
    # initialised at 1/temperature and clamped to ≤ 100 (CLIP's guard).
    temperature: float = 0.05
    learnable_temperature: bool = False
    # hard negatives: top-ranked non-gold turns of the same user under the current encoder,
    # re-mined at the start of every epoch when refresh is on
    hard_negatives: int = 0
    hard_negative_skip: int = 0  # skip the very top non-gold ranks (often unlabelled positives)
    refresh_hard_negatives: bool = True
    # hardware
    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: str = "auto"  # "ddp" for multi-GPU
    precision: str = "auto"  # auto = bf16-mixed on CUDA, 32-true on CPU
    dtype: str = "float32"  # weights' dtype; bfloat16 for a LoRA-trained 7B base
    gradient_checkpointing: bool = False
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None  # None → peft's default for the architecture
    num_workers: int = 0  # DataLoader worker processes for collation (batches are pre-tokenised)
    fused_adamw: bool = True  # AdamW's fused kernel (CPU/CUDA; off under 16-mixed, see module.py)
    torch_compile: bool = False  # compile the transformer (dynamic shapes); pays off on long GPU runs
    # replay each transformer pass (forward and backward) from a CUDA graph, passes padded to length
    # buckets (training/pretrain/graphs.py): a step's host cost no longer grows with the model's depth;
    # one CUDA device, not with torch_compile, gradient_checkpointing or 16-mixed
    cuda_graphs: bool = False
    # transformer passes a step: "none" (queries, positives, hard negatives each their own),
    # "candidates" (positives + hard negatives share one, as sentence-transformers ≥ 6 does), "all"
    # (one pass). Fewer passes = fewer kernel launches, which bound a GPU step at batch 32; more
    # padding, which a CPU step pays for (candidates: ~15 % more CPU per pair, MiniLM). auto:
    # candidates where CUDA trains, none elsewhere
    merge_passes: str = "auto"
    # batch pairs of similar length (within shuffled pools of 64 batches) so padding wastes little;
    # changes which pairs share a batch (the in-batch negatives), so it is off unless asked for
    length_bucketing: bool = False
    # outputs
    checkpoint: bool = True  # one resumable checkpoint, output_dir/checkpoints/last.ckpt, rewritten every epoch
    resume_from: str | None = None  # a checkpoint to continue from ("last" = output_dir's own)
    wandb_project: str | None = None  # W&B only when set and WANDB_MODE != disabled
    wandb_run_name: str | None = None
    log_every_n_steps: int = 10
    progress: bool = True
    # evaluation on the held-out (test) users
    eval_ks: list[int] = field(default_factory=lambda: [5, 10])
    eval_before: bool = True
    rerank: bool = False  # also train the online reranker on top ("pretraining + RR")
    rerank_recipe: str = "auto"
    rerank_epochs: int = 1
    eval_device: str = "auto"

    def __post_init__(self) -> None:
        """Ranges and combinations the field types cannot express (types are checked on loading)."""
        positive_ints = ("batch_size", "max_length", "log_every_n_steps", "rerank_epochs", "lora_r")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PretrainConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise PretrainConfigError(f"epochs must be a positive integer, got {self.epochs!r}")
        if not isinstance(self.hard_negatives, int) or self.hard_negatives < 0:
            raise PretrainConfigError(f"hard_negatives must be an integer ≥ 0, got {self.hard_negatives!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise PretrainConfigError(f"temperature must be > 0, got {self.temperature!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise PretrainConfigError(f"lr must be > 0, got {self.lr!r}")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise PretrainConfigError(f"{name} must be in [0, 1), got {value!r}")
        if self.test_fraction <= 0:
            raise PretrainConfigError("test_fraction must be > 0: the report compares held-out recall")
        if self.val_fraction + self.test_fraction >= 1:
            raise PretrainConfigError("val_fraction + test_fraction must leave users to train on (< 1)")
        if self.precision not in ("auto", "32-true", "32", "bf16-mixed", "16-mixed", "bf16-true"):
            raise PretrainConfigError(f"precision {self.precision!r} is not one of auto, 32-true, bf16-mixed, "
                                      "16-mixed, bf16-true")
        if self.merge_passes not in MERGE_PASSES:
            raise PretrainConfigError(f"merge_passes must be one of {', '.join(MERGE_PASSES)}, got {self.merge_passes!r}")
        if self.cuda_graphs:
            clash = [name for name, on in (("torch_compile", self.torch_compile),
                                           ("gradient_checkpointing", self.gradient_checkpointing),
                                           ("precision 16-mixed", self.precision == "16-mixed"),
                                           ("accelerator cpu", self.accelerator == "cpu")) if on]
            if clash:
                raise PretrainConfigError(f"cuda_graphs does not combine with {', '.join(clash)}")
        if self.num_workers < 0:
            raise PretrainConfigError(f"num_workers must be an integer ≥ 0, got {self.num_workers!r}")
        if not self.eval_ks or any(not isinstance(k, int) or k < 1 for k in self.eval_ks):
            raise PretrainConfigError(f"eval_ks must be a non-empty list of positive integers, got {self.eval_ks!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None, overrides: Sequence[str] | None = None) -> PretrainConfig:
    """A YAML recipe (or the defaults when `path` is None) with `key=value` overrides applied."""
    return _config.load_config(PretrainConfig, path, overrides or (), label="pretraining config")
