"""Who cites during online training, and what their replies cost and yield.

Two kinds of citer answer a training question's selection:

* the simulated citer (`rmm.llm.simulated.SimulatedCiter`), which knows which shown memories
  hit gold evidence and cites with the paper's measured precision and recall — synchronous and
  deterministic per (seed, epoch, question);
* a real generator (any `rmm.llm` spec: `openai:URL@MODEL`, `vllm:PATH`, `hf:PATH`), prompted with
  the paper's answer-with-citations prompt (`rmm.prompts.answer_messages`, or its JSON form with
  `ANSWER_SCHEMA` when `structured`), asked asynchronously (`LLM.agenerate`), its reply read by
  retrospective reflection (`rmm.reflection.reflect_citations`: the tolerant citation parser and
  the worked-example guard). An unusable reply — no parseable citation, or a copy of the prompt's
  example — yields no rewards: it is counted and skipped, never guessed.

`GenerationStats` keeps the counts and costs a report prints (parse failures, LLM calls, tokens,
seconds); it survives a resume through the run's state file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rmm.llm import LLM, Usage, parse_spec
from rmm.llm.simulated import SimulatedCiter
from rmm.policy.citations import parse_citations
from rmm.policy.learner import rewards_from_citations
from rmm.prompts import ANSWER_SCHEMA, answer_messages
from rmm.prompts.render import is_example_answer
from rmm.reflection import reflect_citations
from rmm.types import Memory, Selection

__all__ = ["GenerationStats", "Reply", "citer_kind", "in_process", "llm_answer_prompt", "read_llm_reply",
           "simulated_reply"]


@dataclass
class Reply:
    """What one citer reply taught: rewards per shown memory (None = unusable), and why."""

    rewards: list[float] | None
    cited: int = 0
    no_cite: bool = False
    example_copy: bool = False


@dataclass
class GenerationStats:
    """Replies and their cost, cumulative over a run (resumes included)."""

    replies: int = 0
    unusable: int = 0  # no parseable citation, or a copy of the worked example
    example_copies: int = 0
    no_cite: int = 0
    shown: int = 0
    cited: int = 0
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # wall time of the training stream (generation, updates, bookkeeping)

    def count(self, reply: Reply, n_shown: int) -> None:
        self.replies += 1
        self.shown += n_shown
        self.cited += reply.cited
        self.no_cite += reply.no_cite
        self.example_copies += reply.example_copy
        self.unusable += reply.rewards is None

    def add_usage(self, usage: Usage) -> None:
        self.llm_calls += usage.calls
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens

    def summary(self) -> dict[str, float]:
        """The derived figures a report prints beside the counts."""
        per_reply = max(self.replies, 1)
        return {
            "parse_failure_rate": self.unusable / per_reply,
            "cited_ratio": self.cited / self.shown if self.shown else 0.0,
            "prompt_tokens_per_question": self.prompt_tokens / per_reply,
            "completion_tokens_per_question": self.completion_tokens / per_reply,
            "seconds_per_question": self.seconds / per_reply,
            "questions_per_second": self.replies / self.seconds if self.seconds > 0 else 0.0,
            "completion_tokens_per_second": self.completion_tokens / self.seconds if self.seconds > 0 else 0.0,
        }


def citer_kind(spec: str) -> str:
    """`simulated`, `openai`, `hf` or `vllm` (LLMError for anything else)."""
    return parse_spec(spec)[0]


def in_process(spec: str) -> bool:
    """Whether the generator runs in this process (batched calls) rather than behind a server."""
    return citer_kind(spec) in ("hf", "vllm")


def simulated_reply(citer: SimulatedCiter, hits: Sequence[bool]) -> Reply:
    """The simulated citer's reply, read back through the paper's parser (as an LLM's would be)."""
    m = len(hits)
    citation = parse_citations(citer.respond(hits), m)
    rewards = rewards_from_citations(m, citation.cited, citation.no_cite)
    return Reply(None if rewards is None else rewards.tolist(), len(citation.cited or []), citation.no_cite)


def llm_answer_prompt(question: str, shown: Sequence[Memory], structured: bool) -> list[dict[str, str]]:
    """The paper's answer-with-citations prompt for one training question."""
    return answer_messages(question, shown, structured=structured)


def llm_schema(structured: bool) -> dict | None:
    return ANSWER_SCHEMA if structured else None


def read_llm_reply(raw: str, selection: Selection, structured: bool) -> Reply:
    """Rewards from a real generator's reply, through retrospective reflection's reading of it."""
    feedback = reflect_citations(raw, selection, None, structured=structured, learn=False)
    citation = feedback.citation
    example = feedback.rewards is None and is_example_answer(citation.answer)
    return Reply(feedback.rewards, len(citation.cited or []), citation.no_cite, example)


async def ask(llm: LLM, prompts: list[list[dict[str, str]]], shown: list[list[Memory]], *, structured: bool,
              max_tokens: int) -> list[str]:
    """One call for a batch of training questions (one request each on a server, one batch in process)."""
    return await llm.agenerate(prompts, json_schema=llm_schema(structured), max_tokens=max_tokens,
                               temperature=0.0, shown=shown)
