"""The reranker's optimizer: which parameters step at which rate, and with what.

Eq. 1's two d×d matrices step at the learner's lr; the lexical weight (one scalar) has its own
group, so its rate can differ; with candidate features it joins their weights in a group at
`FEATURE_LR_SCALE` × lr. Adam is torch's, fused where torch has a kernel for the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version

from rmm.policy.recipes import LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker

__all__ = ["FEATURE_LR_SCALE", "LEXICAL_LR_SCALE", "OptimizerStepError", "make_optimizer", "optimizer_step",
           "param_groups"]

# The lexical weight's step relative to lr (`param_groups`). On LoCoMo's training conversations
# (prequential recall@5 of rmm train --retriever hybrid) ×10 and ×30 learned w to 0.42–0.57 from a start
# of 0 or 0.3 but scored 51.5–52.2 against 52.9 for ×1 from 0.3, so the step stays the matrices'.
LEXICAL_LR_SCALE = 1.0
# The candidate feature weights' step (and the lexical weight's beside them) relative to lr. Adam moves each
# about lr per step, so at the matrices' 3e-4 the scalar weights hardly leave their start in a run; the
# online prototype (research/reranker_online_features.py, training users only) learned them at 3e-3 vs 3e-4:
# MSC limit 3000, all features at ×1 −0.3, at ×10 +1.3 R@5 (docs/results/s4/h3/design_note.md).
FEATURE_LR_SCALE = 10.0


class OptimizerStepError(RuntimeError):
    """`optimizer.step()` raised: some parameter groups may have stepped and others not, so the learner's
    state, not a feedback row, is at fault, and a caller that sets bad rows aside
    (`rmm.serve.learner_lease`) must stop instead."""


def param_groups(reranker: ResidualLinearReranker, lr: float) -> list[dict[str, Any]]:
    """Eq. 1's matrices at `lr`; the lexical weight, one scalar, at `LEXICAL_LR_SCALE × lr` (Adam moves
    a parameter about lr per step whatever its gradient: at lr 3e-4 w travels at most ~0.1 in a
    LoCoMo training stream, so its start matters more than its step there). With candidate features
    the lexical weight and the feature weights share one group at `FEATURE_LR_SCALE × lr`: the recipe
    chosen on training streams (`research/reranker_online_features.py`) had w in that group, and over
    candidates without features both get zero gradient, so the coupling changes nothing there."""
    groups: list[dict[str, Any]] = [{"params": [reranker.W_q.weight, reranker.W_m.weight]}]
    if reranker.feature_weight is not None:
        scalars = [w for w in (reranker.lexical_weight, reranker.feature_weight) if w is not None]
        groups.append({"params": scalars, "lr": lr * FEATURE_LR_SCALE})
    elif reranker.lexical_weight is not None:
        groups.append({"params": [reranker.lexical_weight], "lr": lr * LEXICAL_LR_SCALE})
    return groups


def make_optimizer(reranker: ResidualLinearReranker, config: LearnerConfig) -> torch.optim.Optimizer:
    """`torch.optim.Adam` (fused where torch has a kernel for the parameters' device, else foreach) or
    plain SGD, over `param_groups` at `config.lr`. Every step moves the stepped parameters' version
    counters (`_bump_versions`, a step post-hook), whoever calls `step()`."""
    params = param_groups(reranker, config.lr)
    optimizer: torch.optim.Optimizer
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=config.lr)
    else:
        try:
            optimizer = torch.optim.Adam(params, lr=config.lr, fused=True)
        except (RuntimeError, ValueError, TypeError):  # a device without a fused kernel
            optimizer = torch.optim.Adam(params, lr=config.lr, foreach=True)
    optimizer.register_step_post_hook(_after_step)
    return optimizer


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`; a failure is an `OptimizerStepError` (the groups before the failing one may have
    stepped), after moving the version counters of whatever may have been written."""
    try:
        optimizer.step()
    except Exception as exc:
        _bump_versions(optimizer)
        raise OptimizerStepError(f"optimizer step failed ({type(exc).__name__}: {exc}); "
                                 "its parameter groups may be part-stepped") from exc


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step post-hook `make_optimizer` registers (a module-level function: a learner deep-copies and
    pickles with its optimizer)."""
    _bump_versions(optimizer)


def _bump_versions(optimizer: torch.optim.Optimizer) -> None:
    """Move the version counter of every parameter with a gradient: torch's fused Adam writes the weights
    without it (torch 2.13), and caches keyed on `_version` (the reranker's folded query) must see every
    step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if params:
        increment_version(params)
