"""The learner's hyper-parameters: the `LearnerConfig` record and the named recipes that fill it.

`paper` is RMM Appendix A.1 verbatim (τ 0.5, b 0.5, Adam lr 1e-3, batch 4), tuned there for
Contriever's unnormalised dot products. For an L2-normalised encoder (MiniLM, Stella, GTE) the
top-20 scores are cosines a few hundredths apart, so s/τ at τ = 0.5 is nearly flat: Gumbel
sampling is close to uniform and the learner mostly hears "not cited". `normalized` sharpens τ,
uses the running-mean reward baseline and a smaller step; it was chosen on the prequential stream
of LoCoMo's training conversations only (never the held-out ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from rmm.policy.credit import CREDITS, Credit

__all__ = ["RECIPES", "LearnerConfig", "is_normalized_encoder", "recipe_config", "recipe_for"]


@dataclass
class LearnerConfig:
    """`credit` weights the per-pick log π terms (`rmm.policy.credit`); `importance` weights each
    delayed selection by `min(is_clip, π_θ/μ)` (off for `--no-is`; `is_clip = math.inf` leaves
    the ratio untruncated; `is_normalize` divides the batch's ratios by their mean — weighted
    importance sampling: biased for small batches, but a batch of very stale selections no longer
    shrinks the step). `tau` is what `Learner.select` samples with; a selection that recorded
    its own τ is learned at that τ, so sampling and log π never use two different values.
    `lexical_feature`: rerankers a registry builds get the learned weight of the hybrid first
    stage's scaled BM25 score (`rmm.policy.reranker`; our extension of Eq. 1, a no-op for candidates
    without the feature); a learner given a reranker learns whatever that reranker has.
    `candidate_features`: rerankers a registry builds weigh `rmm.memory.features.CANDIDATE_FEATURES`
    (hybrid and bm25:DENSE first stages compute them; zeros for candidates without).
    `extra_features`: more candidate features, weighed after those (a front end's own, e.g. the Semantic
    XPath controller's ``xpath_weight``): their weights start at 0 like the others', candidate lists that
    carry only the leading features count as zeros in them (`rmm.policy.stacking.features_of`), and a
    checkpoint saved without them gains them at 0 (`rmm.policy.growth`)."""

    lr: float = 1e-3
    batch_size: int = 4
    baseline: float | Literal["mean"] = 0.5
    tau: float = 0.5
    estimator: Literal["plackett-luce", "paper"] = "plackett-luce"
    optimizer: Literal["adam", "sgd"] = "adam"
    max_grad_norm: float | None = None
    credit: Credit = "per-pick"
    importance: bool = True
    is_clip: float = 1.0
    is_normalize: bool = False
    lexical_feature: bool = True
    lexical_init: float | None = None  # the lexical weight's start (None: reranker.LEXICAL_INIT)
    candidate_features: bool = True
    extra_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.extra_features, list):  # as a checkpoint's meta (JSON) or a YAML section gives it
            self.extra_features = tuple(self.extra_features)
        if (not isinstance(self.extra_features, tuple) or not all(isinstance(n, str) and n for n in self.extra_features)
                or len(set(self.extra_features)) != len(self.extra_features)):
            raise ValueError(f"extra_features must be distinct non-empty names, got {self.extra_features!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if self.baseline != "mean" and (isinstance(self.baseline, str) or not math.isfinite(self.baseline)):
            raise ValueError(f"baseline must be a finite number or 'mean', got {self.baseline!r}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if self.estimator not in ("plackett-luce", "paper"):
            raise ValueError(f"estimator must be 'plackett-luce' or 'paper', got {self.estimator!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.credit not in CREDITS:
            raise ValueError(f"credit must be one of {CREDITS}, got {self.credit!r}")
        if type(self.importance) is not bool:
            raise ValueError(f"importance must be true or false, got {self.importance!r}")
        if type(self.is_normalize) is not bool:
            raise ValueError(f"is_normalize must be true or false, got {self.is_normalize!r}")
        if type(self.lexical_feature) is not bool:
            raise ValueError(f"lexical_feature must be true or false, got {self.lexical_feature!r}")
        if type(self.candidate_features) is not bool:
            raise ValueError(f"candidate_features must be true or false, got {self.candidate_features!r}")
        if isinstance(self.is_clip, bool) or not isinstance(self.is_clip, (int, float)) or not self.is_clip > 0:
            raise ValueError(f"is_clip must be a number > 0 (inf: no truncation), got {self.is_clip!r}")


RECIPES: dict[str, dict[str, Any]] = {
    "paper": {},
    "normalized": {"tau": 0.05, "baseline": "mean", "lr": 3e-4},
}


def recipe_for(name: str, normalized_encoder: bool) -> dict[str, Any]:
    """`auto` picks `normalized` for L2-normalised encoders and `paper` otherwise."""
    if name == "auto":
        name = "normalized" if normalized_encoder else "paper"
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {sorted(RECIPES)} or 'auto'")
    return {"recipe": name, **RECIPES[name]}


def is_normalized_encoder(encoder: Any) -> bool:
    """Whether an encoder L2-normalises its embeddings (read from its config; False if unknown)."""
    return bool(getattr(getattr(encoder, "config", None), "normalize", False))


def recipe_config(name: str, normalized_encoder: bool, **overrides: Any) -> LearnerConfig:
    """The LearnerConfig of a recipe; `overrides` that are not None win."""
    values = {k: v for k, v in recipe_for(name, normalized_encoder).items() if k != "recipe"}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return LearnerConfig(**values)
