"""The simulated citer behind the LLM interface: answers with citations, and nothing else.

The prompt does not say which shown memories hit gold evidence, so the caller (the evaluator,
which knows the question's gold) supplies an `oracle`: a callable from the memory texts an answer
prompt showed (in shown order, as `rmm.prompts.parse_shown_memories` reads them back) to one
bool per memory. The citer then cites with the paper's measured precision and recall. Every
reply is labelled "[simulated answer]"; extraction, update and judge prompts raise LLMError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Usage
from rmm.llm.simulated import SimulatedCiter
from rmm.prompts import PromptParseError, parse_shown_memories

__all__ = ["Oracle", "SimulatedLLM"]

Oracle = Callable[[list[str]], Sequence[bool]]

ANSWER_LABEL = "[simulated answer]"


class SimulatedLLM(LLM):
    """`generate` for answer prompts only: `[simulated answer] [0, 2]` (or JSON when asked)."""

    def __init__(self, citer: SimulatedCiter | None = None, oracle: Oracle | None = None) -> None:
        super().__init__("simulated")
        self.citer = citer if citer is not None else SimulatedCiter()
        self.oracle = oracle

    def _hits(self, texts: list[str]) -> list[bool]:
        if self.oracle is None:
            raise LLMError(
                "the simulated LLM needs an oracle (memory texts → gold hits): set llm.oracle first"
            )
        hits = [bool(h) for h in self.oracle(texts)]
        if len(hits) != len(texts):
            raise LLMError(f"oracle returned {len(hits)} hits for {len(texts)} shown memories")
        return hits

    def _generate(
        self,
        batch: list[list[Message]],
        *,
        json_schema: dict | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
    ) -> list[str]:
        started = time.perf_counter()
        replies: list[str] = []
        for conversation in batch:
            try:
                texts = parse_shown_memories(conversation)
            except PromptParseError as error:
                raise LLMError(
                    "the simulated backend only answers with citations (answer prompts from "
                    "rmm.prompts.answer_messages); extraction, update and judging need a real LLM "
                    f"(hf:, openai:, vllm:) — {error}"
                ) from error
            hits = self._hits(texts)
            if json_schema is not None:
                replies.append(json.dumps({"answer": ANSWER_LABEL, "citations": self.citer.cite(hits)}))
            else:
                replies.append(self.citer.respond(hits))
        self._record(Usage(calls=len(batch), seconds=time.perf_counter() - started))
        return replies
