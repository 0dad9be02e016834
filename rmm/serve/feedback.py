"""Feedback: what the LLM cited for a selection, turned into rewards for the learner (paper §6).

A selection is claimed exactly once (the claim and the validity checks are one transaction in the
selection store), so feedback sent twice or for an expired selection cannot reward anything.
Feedback the learner could not use because of a caller's mistake — citing only indices that were
never shown — is refused (422) before the claim, so the corrected feedback can still be sent.
A reply without any citation is not a mistake: it is recorded as "no parseable citation".

The update is rebuilt from the selection as it was stored at sampling time (candidate embeddings,
query embedding, τ, weights version, μ, mask, the lexical feature and further features of hybrid
candidates, with the features' names): nothing is re-read from the bank or recomputed, so a
memory edited or deleted since, or a first stage that now computes other features, cannot change
what is learned. Feedback for a greedy selection (`explore=false`) is accepted and stored but not
learned from — top-M picks are not a sample, so there is no behaviour probability to correct
with; the answer says so (`learned`, `reason`).

Over a PostgreSQL bank (`Selections.learns_in_background`) the claim appends the feedback to the
database and the answer returns once it is committed; the replica holding the learner lock
applies it within about a second (`rmm.serve.learner_lease`), so the answer's `updated` is false
and `learned` means "queued for the learner".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rmm.policy.citations import Citation, parse_citations, parse_json_citations
from rmm.policy.learner import rewards_from_citations
from rmm.policy.registry import LearnerRegistry
from rmm.serve.errors import BadRequestError
from rmm.serve.pending import PendingSelection, Selections
from rmm.serve.records import FeedbackResult
from rmm.types import Candidates, Selection

__all__ = ["GREEDY_REASON", "NO_CITATION_REASON", "FeedbackLearner"]

log = logging.getLogger(__name__)

GREEDY_REASON = "greedy selection (explore=false) is not a sample; feedback stored, not learned"
NO_CITATION_REASON = "no parseable citation in the reply; feedback stored, not learned"


class FeedbackLearner:
    """Claims pending selections and records their rewards; counts the optimizer steps taken."""

    def __init__(self, selections: Selections, learners: LearnerRegistry) -> None:
        self.selections, self.learners = selections, learners
        self.deferred = bool(getattr(selections, "learns_in_background", False))
        self.updates = 0
        # called with every claimed selection and its rewards (None: no citation), e.g. the shadow's window
        self.observers: list[Callable[[PendingSelection, Any], object]] = []
        # selections recorded into a learner since the last checkpoint (in-process learning only):
        # marked once a checkpoint holds them, replayed by `replay` after a crash otherwise
        self._unsaved: list[str] = []

    def replay(self) -> int:
        """Record into the learners the stored feedback no checkpoint holds (a kill -9 after the
        last checkpoint), in the order it arrived, exactly as `feedback` recorded it; returns how
        many. Over PostgreSQL the learner replica does this from the feedback table instead."""
        if self.deferred:
            return 0
        rows = self.selections.unsaved_feedback()
        with self.learners.lock:
            for pending, stored in rows:
                self._record(pending, rewards_from_citations(len(pending.chosen), stored.get("cited"),
                                                             bool(stored.get("no_cite"))))
        if rows:
            log.info("replayed %d feedback(s) stored after the last reranker checkpoint", len(rows))
        return len(rows)

    def checkpoint(self, save: Callable[[], int]) -> int:
        """Run the registry's `save` and mark the feedback it now holds, so a restart replays only
        what came after (both under the learners' lock: nothing is recorded in between)."""
        with self.learners.lock:
            saved_ids, self._unsaved = self._unsaved, []
            try:
                saved = save()
            except BaseException:
                self._unsaved = saved_ids + self._unsaved
                raise
        if saved_ids:
            self.selections.mark_checkpointed(saved_ids)
        return saved

    def _record(self, pending: PendingSelection, rewards: Any) -> float | None:
        """One claimed selection into its learner, under the learners' lock (in-process learning)."""
        learner = self.learners.get(pending.reranker_key)
        self._unsaved.append(pending.id)
        if pending.explore or rewards is None:
            return learner.record(rebuild(pending), rewards)
        # the learner's own refusal, minus its per-call WARNING: greedy feedback is routine here
        learner.stats.skipped_greedy += 1
        return None

    def feedback(self, tenant: str, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> FeedbackResult:
        """Rewards from explicit indices, `[NO_CITE]`, or the LLM's raw reply, into the learner."""
        given = sum(x for x in (cited is not None, text is not None, no_cite))
        if given != 1:
            raise BadRequestError("give exactly one of `cited` (indices of the shown memories the answer used), "
                                  "`text` (the LLM's raw reply, citations parsed from it) or `no_cite: true`")
        outcome: dict[str, Any] = {}

        def check(pending: PendingSelection) -> None:
            n = len(pending.chosen)
            if cited is not None:
                bad = [i for i in cited if not 0 <= i < n]
                if bad:
                    raise BadRequestError(f"cited indices {bad} are outside the {n} memories shown (0..{n - 1}); "
                                          "the selection is still open")
                if len(set(cited)) != len(cited):
                    raise BadRequestError(f"cited indices {cited} repeat an index")
                outcome.update(cited=list(cited), no_cite=not cited, warnings=[])
            elif no_cite:
                outcome.update(cited=[], no_cite=True, warnings=[])
            else:
                assert text is not None
                parse = parse_json_citations if structured else parse_citations
                citation = parse(text, n)
                if citation.cited is None and not citation.no_cite:
                    _refuse_out_of_range(parse, text, n)
                outcome.update(cited=citation.cited, no_cite=citation.no_cite, warnings=list(citation.warnings))
            rewards = rewards_from_citations(n, outcome["cited"], outcome["no_cite"])
            reason = NO_CITATION_REASON if rewards is None else None if pending.explore else GREEDY_REASON
            outcome.update(rewards=None if rewards is None else rewards.tolist(), learned=reason is None,
                           reason=reason, reward_tensor=rewards)
            return {key: value for key, value in outcome.items() if key != "reward_tensor"}  # stored with the selection

        pending = self.selections.claim(tenant, selection_id, check)
        rewards = outcome["reward_tensor"]
        for observe in self.observers:
            observe(pending, rewards)
        with self.learners.lock:
            learner = self.learners.get(pending.reranker_key)
            step_before = learner.stats.step
            if self.deferred:  # committed to the feedback table; the lock-holding replica learns it
                if not pending.explore:
                    learner.stats.skipped_greedy += 1
                loss = None
            else:
                loss = self._record(pending, rewards)
            updated = learner.stats.step > step_before
            if updated:
                self.updates += 1
            return FeedbackResult(selection_id=selection_id, rewards=outcome["rewards"],
                                  cited=outcome["cited"], no_cite=outcome["no_cite"], warnings=outcome["warnings"],
                                  updated=updated, loss=loss, learner_step=learner.stats.step,
                                  learner_records=learner.stats.records, learned=outcome["learned"],
                                  reason=outcome["reason"])


def rebuild(pending: PendingSelection) -> Selection:
    """The `Selection` exactly as sampled, from the stored row alone (never from the bank)."""
    if pending.embeddings is None:
        raise ValueError(f"selection {pending.id!r} has no stored candidate embeddings")
    candidates = Candidates(query=pending.query, memory_ids=pending.memory_ids, retriever_scores=pending.scores,
                            embeddings=pending.embeddings, query_embedding=pending.query_embedding,
                            user_id=pending.user_id, lexical=pending.lexical, features=pending.features,
                            feature_names=pending.feature_names)
    return Selection(candidates=candidates, chosen=pending.chosen, scores=pending.scores, logp=pending.logp,
                     noise=pending.noise, explore=pending.explore, id=pending.id, tau=pending.tau,
                     version=pending.version, mask=pending.mask)


# large enough that no index a reply can spell is out of range (the parser caps indices at 9 digits)
_ANY_INDEX = 10**10


def _refuse_out_of_range(parse: Callable[[str, int], Citation], text: str, n: int) -> None:
    """Refuse a reply whose citation names only indices that were never shown (`[7]` of 5): the
    parser drops them and would record "no parseable citation", using up the selection."""
    unbounded = parse(text, _ANY_INDEX)
    # the parser drops an index of more digits than it reads as out of range too: the same mistake
    too_long = any(w.startswith("dropped out-of-range index") for w in unbounded.warnings)
    if unbounded.cited or too_long:
        named = unbounded.cited or "an index of more than 9 digits"
        raise BadRequestError(f"the reply cites {named}, but only {n} memories were shown (valid indices "
                              f"0..{n - 1}); send the corrected reply, `cited`, or `no_cite: true` — the selection "
                              "is still open")
