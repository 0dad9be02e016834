"""REINFORCE on citation rewards (paper Eq. 3, App. A.1, DESIGN.md §4), off-policy corrected.

Each shown memory gets +1 if the generator cited it and −1 otherwise; with baseline b the loss of
a batch is `−mean_queries ρ · Σ_j w_j·log π_j`, π_j the probability of the j-th pick, `w_j` the
credit of pick j (`rmm.policy.credit`: per-pick `r_j − b`, reward-to-go or sequence) and ρ the
truncated importance ratio π_θ/μ of the selection. Rewards arrive after the selection was made
(maybe much later, from another process, after other updates), so the learner keeps what the
Selection recorded at sampling time — the query and candidate embeddings as scored, the picks,
τ, the behaviour log-probability μ, the Gumbel noise (for the paper-literal estimator) — and
recomputes log π *with gradients under the current weights* from it; it never re-reads the store.
Greedy (non-sampled) selections have no μ and are refused.

Hyper-parameters and their recipes live in `rmm.policy.recipes` (re-exported here for callers),
the checkpoint folder format in `rmm.policy.checkpoint`, the optimizer in `rmm.policy.optimizer`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rmm.device import resolve_device
from rmm.errors import CheckpointError
from rmm.policy import growth
from rmm.policy.checkpoint import (
    FORMAT_VERSION,
    read_checkpoint,
    saved_feature_names,
    saved_lexical_feature,
    write_checkpoint,
)
from rmm.policy.credit import log_importance, pick_weights, truncated_importance
from rmm.policy.optimizer import make_optimizer, optimizer_step
from rmm.policy.recipes import (
    RECIPES,
    LearnerConfig,
    is_normalized_encoder,
    recipe_config,
    recipe_for,
)
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.rewarded import RewardedSelection, rewarded, stack_rewarded
from rmm.policy.sampling import paper_literal_logp, plackett_luce_logp
from rmm.types import Candidates, Selection

__all__ = [
    "FORMAT_VERSION",
    "RECIPES",
    "Learner",
    "LearnerConfig",
    "LearnerStats",
    "is_normalized_encoder",
    "recipe_config",
    "recipe_for",
    "rewards_from_citations",
]

log = logging.getLogger(__name__)

@dataclass
class LearnerStats:
    """Counters. `updates` counts batches processed (applied, or skipped as non-finite or as having no
    gradient); `step` counts optimizer steps actually applied (the weights version stamped on selections).
    `skipped_no_gradient` counts batches without a single pick (every record K = 0 or M = 0): their loss
    is a constant, and an Adam step on its zero gradient would still move the weights by momentum.

    Off-policy diagnostics over the selections of applied and skipped updates alike:
    `importance_sum / importance_count` is the mean ρ, `importance_clipped` how often π/μ
    exceeded the clip, `staleness_sum / staleness_count` the mean number of steps between
    sampling and update (selections that recorded their weights version).
    """

    records: int = 0
    updates: int = 0
    skipped_no_citation: int = 0
    skipped_nonfinite: int = 0
    skipped_no_gradient: int = 0
    skipped_greedy: int = 0
    step: int = 0
    last_loss: float | None = None
    reward_sum: float = 0.0
    reward_count: int = 0
    importance_sum: float = 0.0
    importance_count: int = 0
    importance_clipped: int = 0
    staleness_sum: int = 0
    staleness_count: int = 0


def rewards_from_citations(n_shown: int, cited: list[int] | None, no_cite: bool = False) -> Tensor | None:
    """Per shown memory (in shown order): +1 cited, −1 shown but not cited.

    `[NO_CITE]` → all −1 (nothing shown helped). `cited=None` (no parseable citation) → None, which
    the learner counts as a skip: an unreadable reply says nothing about the memories.
    """
    if isinstance(n_shown, bool) or not isinstance(n_shown, int) or n_shown < 0:
        raise ValueError(f"n_shown must be a non-negative int, got {n_shown!r}")
    if no_cite:
        return torch.full((n_shown,), -1.0)
    if cited is None:
        return None
    for index in cited:
        if not 0 <= index < n_shown:
            log.warning("ignoring cited index %s outside [0, %d)", index, n_shown)
    hits = set(cited)
    return torch.tensor([1.0 if i in hits else -1.0 for i in range(n_shown)])  # one op, not one per citation


class Learner:
    """Turns rewarded selections into reranker updates, `batch_size` queries at a time."""

    def __init__(
        self,
        reranker: ResidualLinearReranker,
        config: LearnerConfig | None = None,
        encoder_name: str = "",
        device: str | torch.device = "cpu",
    ) -> None:
        self.config = config if config is not None else LearnerConfig()
        self.device = resolve_device(device)
        self.reranker = reranker.to(self.device)
        self.encoder_name = encoder_name
        self.stats = LearnerStats()
        self.reranker.version = self.stats.step
        self._buffer: list[RewardedSelection] = []
        self._warned_tau: set[float] = set()
        self.last_log_ratio: Tensor | None = None  # log π_θ/μ of each selection in the last `loss`
        self._last_rho: Tensor | None = None  # and its ρ, before any normalising (`_count` reuses it)
        self.optimizer = make_optimizer(self.reranker, self.config)
        # The loaded checkpoint's lexical definition and the step it was loaded at: a save before any
        # update since keeps that label (the weights learned nothing of today's feature yet).
        self._loaded_definition: tuple[str, int] | None = None

    @property
    def dim(self) -> int:
        return self.reranker.dim

    @property
    def pending(self) -> int:
        """Rewarded selections waiting for the next update."""
        return len(self._buffer)

    @property
    def version(self) -> int:
        """The current weights version (= `stats.step`), stamped on the selections it samples."""
        return self.stats.step

    # ---- sampling --------------------------------------------------------------------------
    def select(
        self,
        candidates: Sequence[Candidates],
        m: int,
        *,
        explore: bool = True,
        generator: torch.Generator | None = None,
        exclude: Sequence[Collection[str]] | None = None,
    ) -> list[Selection]:
        """Sample (or, `explore=False`, rank) M of each candidate list at the learner's own τ.

        The way to sample for learning: τ comes from `config.tau`, the selection records it with
        the weights version and μ, so its reward can be `record`ed at any later time.
        """
        return self.reranker.select(candidates, m, tau=self.config.tau, explore=explore, generator=generator,
                                    exclude=exclude)

    # ---- recording -----------------------------------------------------------------------
    def record(self, selection: Selection, rewards: Tensor | None) -> float | None:
        """Store one rewarded selection; update when the batch is full.

        Returns the loss of the update this record triggered, else None (also when the update
        was skipped as non-finite or as having no pick to learn from). Counted and dropped, never an
        error: `rewards=None` (no parseable citation; `stats.skipped_no_citation`) and a greedy selection
        (`explore=False`: it was not sampled, so there is no μ to correct with;
        `stats.skipped_greedy`, with a warning). The selection may be recorded long after it was
        made, after any number of updates: everything the update needs is in it.
        """
        if rewards is None:
            self.stats.skipped_no_citation += 1
            log.info("no parseable citation for selection %s; skipped", selection.id)
            return None
        if not selection.explore:
            self.stats.skipped_greedy += 1
            log.warning("selection %s was greedy (explore=False), not sampled; not learned from", selection.id)
            return None
        self._buffer.append(rewarded(selection, rewards, self.dim, self._tau_of(selection),
                                     self.reranker.feature_names))
        self.stats.records += 1
        if len(self._buffer) >= self.config.batch_size:
            return self._update()
        return None

    def _tau_of(self, selection: Selection) -> float:
        """The τ to learn this selection at: the one it was sampled at (so μ and π agree on it);
        the learner's own for a selection that did not record one."""
        if selection.tau is None:
            return float(self.config.tau)
        tau = float(selection.tau)
        if not tau > 0 or not math.isfinite(tau):
            raise ValueError(f"selection.tau must be a finite number > 0, got {selection.tau!r}")
        if not math.isclose(tau, self.config.tau, rel_tol=1e-6) and tau not in self._warned_tau:
            self._warned_tau.add(tau)
            log.warning("selections sampled at tau=%g, learner configured for tau=%g: learning them at their own "
                        "tau; sample through Learner.select to use one value", tau, self.config.tau)
        return tau

    def flush(self) -> float | None:
        """Update with whatever is buffered (end of a run); None when the buffer is empty."""
        return self._update() if self._buffer else None

    # ---- the update ----------------------------------------------------------------------
    def baseline(self) -> float:
        """The paper's constant b, or with `baseline="mean"` the mean reward seen before this batch.

        A constant b far above the typical reward (b = 0.5 when most shown memories go uncited,
        r = −1) makes nearly every term push probability *away* from what was shown: unbiased, but
        so noisy that Adam's per-weight steps mostly random-walk W. The running mean is the
        textbook variance-reducing choice and leaves the estimator unbiased all the same.
        """
        if self.config.baseline != "mean":
            return float(self.config.baseline)
        return self.stats.reward_sum / self.stats.reward_count if self.stats.reward_count else 0.0

    def loss(self, batch: list[RewardedSelection]) -> Tensor:
        """`−mean_b ρ_b Σ_j w_bj·log π_bj`, log π recomputed with gradients under current weights.

        `w` is the configured credit (`rmm.policy.credit`), ρ = min(is_clip, π_θ/μ) the detached
        truncated importance ratio (1 with `importance=False`; divided by the batch's mean with
        `is_normalize`); `last_log_ratio` keeps log π_θ/μ. Autograd carries it to the parameters.
        """
        self.last_log_ratio = None
        if not batch or max(p.memories.shape[0] for p in batch) == 0 or max(p.chosen.numel() for p in batch) == 0:
            return (self.reranker.W_q.weight.sum() + self.reranker.W_m.weight.sum()) * 0.0
        paper = self.config.estimator == "paper"
        t = stack_rewarded(batch, paper).to(self.device)
        scores = self.reranker.policy_scores(t.queries, t.memories, t.lexical, t.features)
        logits = scores / t.taus.unsqueeze(-1)  # each selection at the τ it was sampled at
        if t.pick_valid is None and t.mask is None:  # no padding, no masks: real picks only (`rewarded` checks them)
            pl_logp = plackett_luce_logp(logits, t.chosen, 1.0, complete=True)
        else:
            pl_logp = plackett_luce_logp(logits, t.chosen, 1.0, t.mask)  # padding picks (-1) score 0
        if paper:
            logp = paper_literal_logp(logits, t.noise / t.taus.unsqueeze(-1), t.chosen, 1.0, t.mask)
        else:
            logp = pl_logp
        advantage = t.rewards - self.baseline()
        if t.pick_valid is not None:  # a padding pick carries no credit (`pick_weights` needs A = 0 there)
            advantage = advantage.masked_fill(~t.pick_valid, 0.0)
        log_ratio = self.last_log_ratio = log_importance(pl_logp, t.behaviour_logp)
        rho = self._last_rho = self._importance(log_ratio)
        if self.config.importance and self.config.is_normalize:
            rho = rho / rho.mean().clamp(min=torch.finfo(rho.dtype).tiny)
        weights = pick_weights(advantage, self.config.credit)
        return -(rho * (weights * logp).sum(-1)).mean()

    def _importance(self, log_ratio: Tensor) -> Tensor:
        """ρ per selection: min(is_clip, π_θ/μ), or 1 with `importance=False`."""
        if self.config.importance:
            return truncated_importance(log_ratio, self.config.is_clip)
        return torch.ones_like(log_ratio)

    def _update(self) -> float | None:
        batch, self._buffer = self._buffer, []
        self.stats.updates += 1
        if not any(p.chosen.numel() for p in batch):  # every record K = 0 or M = 0: nothing to learn from
            return self._skip_no_gradient(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        self._count(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            return self._skip_nonfinite(f"loss is {value}")
        loss.backward()
        grads = [p.grad for p in self.reranker.parameters() if p.grad is not None]
        # One reduction instead of an elementwise isfinite per d×d gradient: a sum is NaN/inf
        # whenever any element is (or when finite values overflow — worth skipping as well).
        if grads and not math.isfinite(float(torch.stack([g.sum() for g in grads]).sum())):
            return self._skip_nonfinite("gradients are not finite")
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.reranker.parameters(), self.config.max_grad_norm)
        optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.reranker.invalidate()
        self.stats.step += 1
        self.reranker.version = self.stats.step
        self.stats.last_loss = value
        return value

    def _count(self, batch: list[RewardedSelection]) -> None:
        self.stats.reward_sum += float(sum(p.rewards.sum() for p in batch))
        self.stats.reward_count += sum(p.rewards.numel() for p in batch)
        if self.last_log_ratio is not None:
            log_ratio, rho = self.last_log_ratio, self._last_rho
            if not math.isfinite(float(log_ratio.sum())):  # some ratio is not finite: count the others
                log_ratio = log_ratio[torch.isfinite(log_ratio)]
                rho = self._importance(log_ratio)
            self.stats.importance_sum += float(rho.sum())
            self.stats.importance_count += int(log_ratio.numel())
            if self.config.importance:
                self.stats.importance_clipped += int((log_ratio > math.log(self.config.is_clip)).sum())
        stale = [self.stats.step - p.version for p in batch if p.version is not None]
        self.stats.staleness_sum += sum(stale)
        self.stats.staleness_count += len(stale)

    def _skip_nonfinite(self, why: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.stats.skipped_nonfinite += 1
        log.warning("reranker update skipped (%s); parameters unchanged", why)

    def _skip_no_gradient(self, batch: list[RewardedSelection]) -> None:
        """A batch without a pick: no optimizer step (Adam's momentum would move the weights and its step
        count would advance on a zero gradient); its selections still count in the off-policy stats."""
        self.last_log_ratio = self._last_rho = None
        self._count(batch)
        self.stats.skipped_no_gradient += 1
        log.info("reranker update skipped: no record in the batch of %d has a pick", len(batch))

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the checkpoint folder atomically (temp sibling, then swap); returns its path."""
        meta: dict[str, Any] = {"dim": self.dim, "encoder_name": self.encoder_name, "step": self.stats.step,
                                "stats": asdict(self.stats), "config": asdict(self.config),
                                "lexical_feature": self.reranker.lexical_feature,
                                "feature_names": list(self.reranker.feature_names)}
        kept = self._loaded_definition
        if self.reranker.lexical_feature and kept is not None and kept[1] == self.stats.step:
            meta["lexical_definition"] = kept[0]  # no update since loading: still what it was trained on
        target = write_checkpoint(
            path,
            weights=self.reranker.state_dict(),
            training={"optimizer": self.optimizer.state_dict(), "pending": [p.to_state() for p in self._buffer]},
            meta=meta,
        )
        log.info("saved reranker checkpoint %s (step %d)", target, self.stats.step)
        return target

    @classmethod
    def load(
        cls,
        path: str | Path,
        encoder_name: str | None = None,
        dim: int | None = None,
        device: str | torch.device = "cpu",
        lexical_feature: bool | None = None,
        feature_names: Sequence[str] | None = None,
    ) -> Learner:
        """Resume from `save`'s folder; refuses another encoder or dimension than expected.

        A format-1 checkpoint is upgraded on load: its config and stats take the new fields'
        defaults, and its buffered records — saved without τ or μ — are taken as sampled at the
        learner's τ by the weights just loaded (ρ = 1 at the next update, which is what version 1
        did with them). The reranker's own terms are in the meta (`config.lexical_feature` and
        `candidate_features` are what a registry builds new rerankers with). A checkpoint without the
        lexical weight (formats 1–2, or saved without) loaded with `lexical_feature=True`, or without
        feature weights (formats 1–4, or `feature_names: []`) loaded with `feature_names`, gains them at
        0 (`rmm.policy.growth`): the ranking is unchanged, saved parameters keep their optimizer state,
        and the next save records them. One that has the lexical weight or feature weights the run does
        not ask for (`lexical_feature=False`, other `feature_names`) is refused: dropping them would
        change the ranking. None (not given): the checkpoint's terms as saved."""
        saved = read_checkpoint(path, encoder_name=encoder_name, dim=dim)
        meta = saved.meta
        had = growth.Terms(saved_lexical_feature(saved.folder, meta, lexical_feature),
                           saved_feature_names(saved.folder, meta, feature_names))
        terms = growth.terms_to_load(had, lexical_feature, feature_names)
        try:
            config = LearnerConfig(**{f.name: meta["config"][f.name] for f in fields(LearnerConfig)
                                      if f.name in meta["config"]})
            reranker = growth.build_reranker(int(meta["dim"]), saved.weights, terms, had)
            learner = cls(reranker, config, encoder_name=meta["encoder_name"], device=device)
            growth.load_optimizer_state(learner.optimizer, learner.reranker, saved.training["optimizer"], had)
            learner.stats = LearnerStats(**meta["stats"])
            learner.reranker.version = learner.stats.step
            learner._buffer = [learner._restore_pending(s) for s in saved.training["pending"]]
            for record in learner._buffer:  # a widened reranker (`extra_features`): zero columns for the rest
                record.features = growth.widen_features(record.features, len(terms.feature_names))
            if had.lexical:
                learner._loaded_definition = (str(meta["lexical_definition"]), learner.stats.step)
        except Exception as exc:  # shape, key and value errors all mean the same to a user
            raise CheckpointError(f"cannot load reranker checkpoint {saved.folder}: {exc}") from exc
        growth.log_gains(saved.folder, terms, had)
        if meta["format_version"] < FORMAT_VERSION:
            log.info("upgraded reranker checkpoint %s from format %s to %s (saved on the next save)",
                     saved.folder, meta["format_version"], FORMAT_VERSION)
        return learner

    def _restore_pending(self, state: dict[str, Any]) -> RewardedSelection:
        if "behaviour_logp" in state:
            return RewardedSelection.from_state(state)
        # format 1: no τ, no μ — the record was meant for the weights it was saved with
        tau = float(self.config.tau)
        chosen = state["chosen"].long()
        with torch.no_grad():
            scores = self.reranker.policy_scores(state["query"][None].to(self.device),
                                                 state["memories"][None].to(self.device))
            mu = plackett_luce_logp(scores, chosen[None].to(self.device), tau)[0].cpu()
        return RewardedSelection(query=state["query"], memories=state["memories"], chosen=chosen, rewards=state["rewards"],
                        noise=state.get("noise"), tau=tau, behaviour_logp=mu)

