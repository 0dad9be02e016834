"""The reranker's optimizer: which parameters step at which rate, and with what.

Eq. 1's two d×d matrices step at the learner's lr; the lexical weight (one scalar) has its own
group, so its rate can differ; with candidate features it joins their weights in a group at
`FEATURE_LR_SCALE` × lr. Adam is the fused implementation where torch has one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.autograd.graph import increment_version

from rmm.policy.recipes import LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker

__all__ = ["FEATURE_LR_SCALE", "LEXICAL_LR_SCALE", "OptimizerStepError", "make_optimizer", "optimizer_step", "param_groups"]

# The lexical weight's step relative to lr (`param_groups`). On LoCoMo's training conversations
# (prequential recall@5 of rmm train --retriever hybrid) ×10 and ×30 learned w to 0.42–0.57 from a start
# of 0 or 0.3 but scored 51.5–52.2 against 52.9 for ×1 from 0.3, so the step stays the matrices'.
LEXICAL_LR_SCALE = 1.0
# The candidate feature weights' step (and the lexical weight's beside them) relative to lr. Adam moves each
# about lr per step, so at the matrices' 3e-4 the scalar weights hardly leave their start in a run; the
# online prototype (scripts/reranker_online_features.py, training users only) learned them at 3e-3 vs 3e-4:
# MSC limit 3000, all features at ×1 −0.3, at ×10 +1.3 R@5 (docs/results/s4/h3/design_note.md).
FEATURE_LR_SCALE = 10.0

log = logging.getLogger(__name__)


class OptimizerStepError(RuntimeError):
    """A step applied to some parameter groups and not others: the learner's state, not a feedback row,
    is at fault, so a caller that sets bad rows aside (`rmm.serve.learner_lease`) must stop instead."""


# Set once a direct call of fused Adam's kernel failed: this process steps through `step()` from then on.
_direct_disabled = False


def param_groups(reranker: ResidualLinearReranker, lr: float) -> list[dict[str, Any]]:
    """Eq. 1's matrices at `lr`; the lexical weight, one scalar, at `LEXICAL_LR_SCALE × lr` (Adam moves
    a parameter about lr per step whatever its gradient: at lr 3e-4 w travels at most ~0.1 in a
    LoCoMo training stream, so its start matters more than its step there). With candidate features
    the lexical weight and the feature weights share one group at `FEATURE_LR_SCALE × lr`: the recipe
    chosen on training streams (`scripts/reranker_online_features.py`) had w in that group, and over
    candidates without features both get zero gradient, so the coupling changes nothing there."""
    groups: list[dict[str, Any]] = [{"params": [reranker.W_q.weight, reranker.W_m.weight]}]
    if reranker.feature_weight is not None:
        scalars = [w for w in (reranker.lexical_weight, reranker.feature_weight) if w is not None]
        groups.append({"params": scalars, "lr": lr * FEATURE_LR_SCALE})
    elif reranker.lexical_weight is not None:
        groups.append({"params": [reranker.lexical_weight], "lr": lr * LEXICAL_LR_SCALE})
    return groups


def make_optimizer(reranker: ResidualLinearReranker, config: LearnerConfig) -> torch.optim.Optimizer:
    """Adam (fused where torch supports it: one pass over the d×d states, ~10× faster on CPU
    at d=768 than the per-tensor loop) or plain SGD, over `param_groups` at `config.lr`."""
    params = param_groups(reranker, config.lr)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    try:
        return torch.optim.Adam(params, lr=config.lr, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device without a fused kernel
        return torch.optim.Adam(params, lr=config.lr)


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`; for a plain fused Adam, its kernel called directly. Either way the stepped
    parameters' version counters move afterwards (`_bump_versions`).

    `Optimizer.step`'s wrappers (profiler range, hooks, dynamo guards, per-group bookkeeping) cost
    about as much as the fused kernel itself on a small CPU update. With nothing they would act on —
    no hooks, no grad scaler, no AMSGrad/maximize/capturable/differentiable/weight-decay variants, no
    instance-level `step` override, every state made — this calls what `torch.optim.adam._fused_adam`
    calls, in the same order, on the same arguments: the same weights and states, bit for bit.
    Anything else goes through `step()`, and so does everything after the direct call once failed
    (a torch without the private names it uses, or a kernel that refuses its arguments).
    """
    calls = None if _direct_disabled else _direct_fused_adam(optimizer)
    try:
        if calls is None:
            optimizer.step()
        else:
            _direct_step(optimizer, calls)
    finally:  # a part-applied step too: a cache keyed on `_version` must not outlive weights that moved
        _bump_versions(optimizer)


def _direct_step(optimizer: torch.optim.Optimizer, calls: list[tuple[list, tuple, dict[str, Any]]]) -> None:
    """The fused kernel per group. If the first group's call fails, its step counts (advanced before
    the kernel, which writes nothing when it refuses its arguments) are put back, the failure is logged
    once, and this step and every later one go through `step()`."""
    global _direct_disabled
    for i, (steps, args, kwargs) in enumerate(calls):
        torch._foreach_add_(steps, 1)
        try:
            _fused_adam_kernel(args, kwargs)
        except Exception as exc:
            torch._foreach_sub_(steps, 1)  # whole numbers in float: the counts are what they were, exactly
            _direct_disabled = True
            log.warning("fused Adam's kernel called directly failed (%s: %s); optimizer.step() from now on",
                        type(exc).__name__, exc)
            if i:  # earlier groups already stepped: step() would step them twice
                raise OptimizerStepError(f"fused Adam's kernel failed on parameter group {i} after stepping the "
                                   "groups before it; the optimizer is part-stepped") from exc
            optimizer.step()
            return


def _fused_adam_kernel(args: tuple, kwargs: dict[str, Any]) -> None:
    """`torch._fused_adam_`, what `torch.optim.adam._fused_adam` calls (a seam tests make fail)."""
    torch._fused_adam_(*args, **kwargs)


def _bump_versions(optimizer: torch.optim.Optimizer) -> None:
    """Move the version counter of every parameter with a gradient: torch's fused Adam writes the weights
    without it, and caches keyed on `_version` (the reranker's folded query) must see every step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if params:
        increment_version(params)


def _direct_fused_adam(optimizer: torch.optim.Optimizer) -> list[tuple[list, tuple, dict[str, Any]]] | None:
    """The fused kernel calls `optimizer.step()` would make, or None where it does more than those (or
    where this torch lacks a name the direct call relies on)."""
    if type(optimizer) is not torch.optim.Adam or "step" in vars(optimizer) or _hooked(optimizer) or \
            not hasattr(torch, "_fused_adam_") or \
            getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return None  # an instance-level `step` (LRScheduler's patch, profiler/accelerate wrappers) must run
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("amsgrad") or group.get("maximize") or group.get("capturable") \
                or group.get("differentiable") or group.get("decoupled_weight_decay") \
                or isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state.get(p) for p in params]
        if any(not s or "step" not in s for s in states) or \
                len({(p.device, p.dtype) for p in params}) != 1 or any(p.is_complex() for p in params):
            return None  # first step (states made by step()), or more than one device/dtype group
        steps = [s["step"] for s in states]
        args = (params, [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], steps)
        beta1, beta2 = group["betas"]
        kwargs = {"amsgrad": False, "lr": group["lr"], "beta1": beta1, "beta2": beta2,
                  "weight_decay": group["weight_decay"], "eps": group["eps"], "maximize": False,
                  "grad_scale": None, "found_inf": None}
        calls.append((steps, args, kwargs))
    return calls


_MISSING = object()


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step hook, the optimizer's own or a global one (`register_optimizer_step_*_hook`), is
    registered — or this torch keeps them under names we do not know (then assume so)."""
    from torch.optim import optimizer as module

    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", _MISSING),
             getattr(optimizer, "_optimizer_step_post_hooks", _MISSING),
             getattr(module, "_global_optimizer_pre_hooks", _MISSING),
             getattr(module, "_global_optimizer_post_hooks", _MISSING))
    return any(h is _MISSING or bool(h) for h in hooks)
