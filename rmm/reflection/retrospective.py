"""Retrospective reflection (paper §6): the generator's citations become the reranker's rewards.

Cited memories get +1, shown-but-uncited −1, `[NO_CITE]` all −1; a reply without a parseable
citation teaches nothing and is skipped (the learner counts it), and so does a reply that copies
the prompt's worked example: its indices are the example's, not a judgement of these memories.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rmm.policy.citations import Citation, parse_citations, parse_json_citations
from rmm.policy.learner import Learner, rewards_from_citations
from rmm.prompts.render import is_example_answer
from rmm.types import Selection

__all__ = ["CitationFeedback", "reflect_citations"]


@dataclass
class CitationFeedback:
    citation: Citation
    rewards: list[float] | None  # per shown memory; None = skipped (no parseable citation)


def reflect_citations(raw: str, selection: Selection | None, learner: Learner | None, *,
                      structured: bool = False, learn: bool = True) -> CitationFeedback:
    """Parse the reply's citations and hand the rewards to the learner (when learning)."""
    n_shown = len(selection.chosen) if selection is not None else 0
    citation = (parse_json_citations if structured else parse_citations)(raw, n_shown)
    if (citation.cited is not None or citation.no_cite) and is_example_answer(citation.answer):
        citation = replace(citation, cited=None, no_cite=False, warnings=[
            *citation.warnings, "the reply copies the prompt's worked example; its citations were ignored"])
    rewards = rewards_from_citations(n_shown, citation.cited, citation.no_cite)
    if learn and learner is not None and selection is not None and n_shown:
        learner.record(selection, rewards)
    return CitationFeedback(citation, None if rewards is None else rewards.tolist())
