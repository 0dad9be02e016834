"""What a controller learns from one question: each sampled selection's shown memories rewarded by
whether the LLM used them.

Every controller that issues several retrievals per question (GOAL-MEM, MemR³, CompassMem) ends
the same way: a shown memory the evidence or the answer used is +1, any other shown memory −1 —
but only when something attributable was read (a reply that could not be parsed says nothing about
what helped, so its selections are delivered without rewards and nothing is learned from them).
The learner learns from the behaviour log-probabilities recorded when each selection was sampled.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

from rmm.types import Selection

__all__ = ["reward_selections"]


def reward_selections(learner: Any, selections: Iterable[tuple[Selection, Any]], helped: Collection[str],
                      attributable: bool) -> None:
    """Deliver every `(selection, record)` to `learner`: ±1 per shown memory by membership in
    `helped` when `attributable`, else no rewards; the record (its trace row) keeps what was given."""
    for selection, record in selections:
        rewards = None
        if attributable:
            rewards = torch.tensor([1.0 if i in helped else -1.0 for i in selection.memory_ids])
        record.reward = None if rewards is None else rewards.tolist()
        learner.record(selection, rewards)
