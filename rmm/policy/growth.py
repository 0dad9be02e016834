"""A loaded reranker gains the terms a run asks for and its checkpoint predates, at weight 0.

A checkpoint saved without the lexical weight (formats 1–2, or `lexical_feature: false`) or without
candidate feature weights (formats 1–4, or `feature_names: []`) is loaded by a run that asks for
them: the reranker gains them at 0 (docs/results/s4/h3/design_note.md item 4: "features unknown to
the checkpoint start at w = 0, adding a feature never changes an untrained ranking"), so its
ranking is the saved one until they learn, and the next save records them. Likewise a checkpoint
whose feature names are the leading ones the run asks for (`LearnerConfig.extra_features`, e.g. the
Semantic XPath controller's ``xpath_weight`` after the hybrid first stage's): `feature_weight` is
widened with zeros for the rest, its saved Adam moments likewise (the new entries' moments start at
0 under the parameter's saved step count), and buffered records' features get zero columns. Loading it without them
instead would save it without them, and the next start — asking for them again — would refuse it.

The lexical weight gains 0.0, not `LEXICAL_INIT`: the init is an untrained reranker's starting
blend, but this one is trained, and a nonzero start would change its ranking on load.

The optimizer keeps every saved parameter's state (Adam's moments and step), matched by parameter
*name*: a gained weight can land between saved ones (the lexical weight goes before the feature
weights), so positions move. Its groups are a freshly built learner's (`param_groups`), the gained
weights in theirs with no state yet (Adam starts theirs at their first step).

The other direction — a checkpoint that has a term the run does not ask for — is refused by
`rmm.policy.checkpoint.saved_lexical_feature` / `saved_feature_names`: dropping learned weights
would silently change the ranking.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rmm.errors import CheckpointError
from rmm.policy.optimizer import param_groups
from rmm.policy.reranker import ResidualLinearReranker

__all__ = ["Terms", "build_reranker", "load_optimizer_state", "log_gains", "terms_to_load", "widen_features"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Terms:
    """Which of Eq. 1's extensions a reranker has: the lexical weight, and the candidate features it weighs."""

    lexical: bool
    feature_names: tuple[str, ...]


def terms_to_load(saved: Terms, lexical_feature: bool | None, feature_names: Sequence[str] | None) -> Terms:
    """The terms the loaded reranker gets: the saved ones, plus those the run asks for and the checkpoint
    has none of. `saved` has been checked against the ask already: a saved term the run does not ask for
    was refused there."""
    asked = tuple(feature_names or ())
    extends = len(asked) > len(saved.feature_names) and asked[:len(saved.feature_names)] == saved.feature_names
    return Terms(saved.lexical or bool(lexical_feature), asked if extends else saved.feature_names)


def log_gains(folder: Path, terms: Terms, saved: Terms) -> None:
    """One INFO line naming what a loaded reranker gained, if anything."""
    names = _gained_names(terms, saved)
    new_features = list(terms.feature_names[len(saved.feature_names):])
    gained = (["the lexical weight"] if "lexical_weight" in names else []) + (
        [f"candidate feature weights {new_features}"] if new_features else [])
    if gained:
        log.info("reranker checkpoint %s was saved without %s, which this run asks for: gained at 0, so its "
                 "ranking is unchanged until they learn; the next save records them", folder, " and ".join(gained))


def build_reranker(dim: int, weights: dict[str, Tensor], terms: Terms, saved: Terms) -> ResidualLinearReranker:
    """A reranker with `terms` holding the saved `weights`; the weights of terms `saved` lacks start at 0."""
    reranker = ResidualLinearReranker(dim, lexical_feature=terms.lexical, lexical_init=0.0,
                                      feature_names=terms.feature_names)
    gained = _gained_names(terms, saved)
    if saved.feature_names and len(terms.feature_names) > len(saved.feature_names) and "feature_weight" in weights:
        weights = {**weights, "feature_weight": _widen(weights["feature_weight"], len(saved.feature_names),
                                                       len(terms.feature_names))}
    missing, unexpected = reranker.load_state_dict(weights, strict=False)
    if unexpected or set(missing) != gained:
        # what strict loading would say; a saved weight missing here is a corrupt checkpoint, not a gain
        wanted = sorted(set(missing) - gained)
        raise RuntimeError(f"weights lack {wanted} or hold unexpected {sorted(unexpected)}")
    return reranker


def load_optimizer_state(optimizer: torch.optim.Optimizer, reranker: ResidualLinearReranker,
                         state: dict[str, Any], saved: Terms) -> None:
    """Load the saved optimizer `state` into `optimizer` (built over `reranker`): as it is when the
    reranker has the saved terms, else each saved parameter's state carried over by name into the
    fresh optimizer's groups (module docstring)."""
    if Terms(reranker.lexical_feature, reranker.feature_names) == saved:
        optimizer.load_state_dict(state)
        return
    saved_names = _order(ResidualLinearReranker(1, lexical_feature=saved.lexical,
                                                feature_names=saved.feature_names))
    saved_ids = [i for group in state["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(saved_names):
        raise CheckpointError(f"the optimizer state holds {len(saved_ids)} parameters, the saved reranker "
                              f"{len(saved_names)} ({', '.join(saved_names)})")
    new_ids = {name: i for i, name in enumerate(_order(reranker))}
    fresh = optimizer.state_dict()  # today's groups, no state; parameters numbered in `_order(reranker)`
    fresh["state"] = {new_ids[name]: state["state"][i] for i, name in zip(saved_ids, saved_names)
                      if i in state["state"]}
    old, new = len(saved.feature_names), len(reranker.feature_names)
    if old and new > old and new_ids["feature_weight"] in fresh["state"]:  # widened: zero moments for the rest
        fresh["state"][new_ids["feature_weight"]] = {
            key: _widen(value, old, new) if isinstance(value, Tensor) and value.shape == (old,) else value
            for key, value in fresh["state"][new_ids["feature_weight"]].items()}
    optimizer.load_state_dict(fresh)


def widen_features(features: Tensor | None, width: int) -> Tensor | None:
    """A buffered record's `[K, F]` features with zero columns up to `width` (a widened reranker's)."""
    if features is None or features.shape[-1] >= width:
        return features
    return torch.cat([features, features.new_zeros(*features.shape[:-1], width - features.shape[-1])], -1)


def _widen(vector: Tensor, old: int, new: int) -> Tensor:
    """A saved `[old]` feature vector (weights, or an optimizer moment) followed by zeros up to `[new]`."""
    if vector.shape != (old,):
        raise CheckpointError(f"the saved feature weights have shape {tuple(vector.shape)}, the meta names {old}")
    return torch.cat([vector, vector.new_zeros(new - old)])


def _order(reranker: ResidualLinearReranker) -> list[str]:
    """The reranker's parameter names in the order its optimizer numbers them (`param_groups`)."""
    name_of = {id(p): name for name, p in reranker.named_parameters()}
    return [name_of[id(p)] for group in param_groups(reranker, 1.0) for p in group["params"]]


def _gained_names(terms: Terms, saved: Terms) -> set[str]:
    gained = set()
    if terms.lexical and not saved.lexical:
        gained.add("lexical_weight")
    if terms.feature_names and not saved.feature_names:
        gained.add("feature_weight")
    return gained
