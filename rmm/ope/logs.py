"""A logged selection as the estimators read it, and the target policies they evaluate.

`LoggedSelection` is what one sampled, rewarded retrieval leaves (a `Selection` plus its rewards):
the K candidates as scored (query and memory embeddings, lexical feature, candidate features), the
logging policy's scores and τ (so μ's inclusion probabilities can be computed for *every*
candidate, not only the picks), its log-probability of each pick, the ordered picks and their
rewards. Where the rows come from (`rmm serve`'s selection stores, a training run) is the
command's business (`rmm.cli.ope`); nothing here reads a database.

A target policy gives each row's logits (scores / τ) and whether it samples (Plackett–Luce top-M,
what `explore=true` serves) or takes the top M deterministically (`greedy`, `explore=false`):

- `RerankerTarget`: any `ResidualLinearReranker` (a checkpoint, a run's learner), scored through its
  public `fast_scores` on the stored embeddings and features — exactly what it would have scored;
- `UniformTarget`: every valid candidate alike (M/K inclusion each);
- `retriever_target(rows)`: an untrained reranker with the terms the logs carry — the ranking rmm
  serves before learning anything (q·m, plus `LEXICAL_INIT`·f over hybrid candidates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.sampling import plackett_luce_logp
from rmm.policy.stacking import features_of, lexical_of, stack_candidates, stack_features, stack_lexical
from rmm.types import Candidates, Selection

__all__ = ["LoggedSelection", "RerankerTarget", "TargetPolicy", "UniformTarget", "behaviour_mismatch",
           "logged_from_selection", "retriever_target"]


@dataclass
class LoggedSelection:
    """One sampled retrieval and its per-pick rewards, as logged under μ."""

    query: Tensor  # [d]
    memories: Tensor  # [K, d] candidate embeddings as scored
    scores: Tensor  # [K] μ's scores (before dividing by τ)
    tau: float  # μ's sampling temperature
    chosen: Tensor  # [M] long, picks in order
    rewards: Tensor  # [M] per pick (+1 cited, −1 shown but not cited)
    behaviour_logp: Tensor  # [M] log μ of each pick given the ones before
    mask: Tensor | None = None  # [K] bool, True = could be picked
    lexical: Tensor | None = None  # [K]
    features: Tensor | None = None  # [K, F]
    feature_names: tuple[str, ...] = ()
    id: str = ""
    meta: dict[str, object] = field(default_factory=dict)  # where it came from (user, reranker key, version)

    def __post_init__(self) -> None:
        k, m = self.memories.shape[0], self.chosen.numel()
        if self.scores.shape != (k,) or self.rewards.shape != (m,) or self.behaviour_logp.shape != (m,):
            raise ValueError(f"logged selection {self.id!r}: scores {tuple(self.scores.shape)}, rewards "
                             f"{tuple(self.rewards.shape)}, logp {tuple(self.behaviour_logp.shape)} for K={k}, M={m}")
        if not self.tau > 0:
            raise ValueError(f"logged selection {self.id!r} has temperature {self.tau}; a sample needs τ > 0")

    @property
    def k(self) -> int:
        return int(self.memories.shape[0])

    @property
    def m(self) -> int:
        return int(self.chosen.numel())

    def candidates(self) -> Candidates:
        """The candidates as scored (what a reranker target rescores)."""
        return Candidates(query="", memory_ids=[str(i) for i in range(self.k)], retriever_scores=self.scores,
                          embeddings=self.memories, query_embedding=self.query, lexical=self.lexical,
                          features=self.features, feature_names=self.feature_names)


def logged_from_selection(selection: Selection, rewards: Sequence[float] | Tensor) -> LoggedSelection:
    """A sampled `Selection` and its rewards as a logged row; refuses a greedy one (no μ to correct by)."""
    c = selection.candidates
    if not selection.explore or selection.logp is None or selection.tau is None:
        raise ValueError(f"selection {selection.id!r} was not sampled (explore=false or no μ): no propensity")
    if c.embeddings is None or c.query_embedding is None:
        raise ValueError(f"selection {selection.id!r} carries no candidate embeddings")
    return LoggedSelection(query=c.query_embedding.float(), memories=c.embeddings.float(),
                           scores=selection.scores.float(), tau=float(selection.tau),
                           chosen=torch.as_tensor(selection.chosen, dtype=torch.long),
                           rewards=torch.as_tensor(rewards, dtype=torch.float32).reshape(-1),
                           behaviour_logp=selection.logp.float().reshape(-1), mask=selection.mask, lexical=c.lexical,
                           features=c.features, feature_names=tuple(c.feature_names), id=selection.id,
                           meta={"user": c.user_id, "version": selection.version})


def behaviour_mismatch(rows: Sequence[LoggedSelection]) -> list[float]:
    """Per row, max |log μ(pick) recomputed from the stored scores and τ − the logged one|: a row
    whose stored scores are not the ones it was sampled from cannot give μ's inclusion probabilities."""
    out = []
    for r in rows:
        logp = plackett_luce_logp(r.scores.double()[None], r.chosen[None], r.tau,
                                  None if r.mask is None else r.mask.bool()[None])[0]
        out.append(float((logp - r.behaviour_logp.double()).abs().max()) if r.m else 0.0)
    return out


class TargetPolicy(Protocol):
    """What the estimators evaluate: logits per row, sampled (Plackett–Luce top-M) or greedy."""

    name: str
    greedy: bool

    def logits(self, rows: Sequence[LoggedSelection]) -> list[Tensor]: ...


@dataclass
class RerankerTarget:
    """A reranker sampling at `tau` (None: each row's logged τ), or its top M when `greedy`."""

    reranker: ResidualLinearReranker
    tau: float | None = None
    greedy: bool = False
    name: str = "reranker"

    def logits(self, rows: Sequence[LoggedSelection]) -> list[Tensor]:
        """Its scores of each row's stored candidates (`fast_scores`, as `select` scores them) / τ."""
        out: list[Tensor] = []
        weight = self.reranker.W_q.weight
        for start in range(0, len(rows), 256):
            chunk = rows[start:start + 256]
            cands = [r.candidates() for r in chunk]
            queries, memories, _ = stack_candidates(cands, self.reranker.dim, weight.device, weight.dtype)
            k_max = memories.shape[1]
            lexical = (None if self.reranker.lexical_weight is None
                       else stack_lexical(lexical_of(cands), k_max, weight.device, weight.dtype))
            names = self.reranker.feature_names
            features = (None if self.reranker.feature_weight is None
                        else stack_features(features_of(cands, names), k_max, len(names), weight.device, weight.dtype))
            scores = self.reranker.fast_scores(queries, memories, lexical, features).detach().cpu()
            for r, s in zip(chunk, scores):
                out.append(s[: r.k].double() / (r.tau if self.tau is None else self.tau))
        return out


@dataclass
class UniformTarget:
    """Every valid candidate alike: the floor a learned reranker has to clear."""

    name: str = "uniform"
    greedy: bool = False

    def logits(self, rows: Sequence[LoggedSelection]) -> list[Tensor]:
        return [torch.zeros(r.k, dtype=torch.float64) for r in rows]


def retriever_target(rows: Sequence[LoggedSelection], tau: float | None = None,
                     greedy: bool = False) -> RerankerTarget:
    """An untrained reranker with the terms the rows carry: what rmm serves before it has learned."""
    if not rows:
        raise ValueError("no logged selections to size the retriever baseline by")
    first = rows[0]
    reranker = ResidualLinearReranker(int(first.query.numel()), lexical_feature=first.lexical is not None,
                                      feature_names=first.feature_names)
    return RerankerTarget(reranker, tau=tau, greedy=greedy, name="retriever")
