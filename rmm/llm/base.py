"""The one interface every LLM backend implements: a batch of chats in, one text per chat out.

Batched because every caller (extraction over a conversation's sessions, answering a batch of
benchmark questions) has many independent prompts, and every real backend (a vLLM server, the
in-process engine, `generate` with padding) is much faster when it sees them together.

Answer call sites also pass `shown=` — per conversation, the memories its prompt showed, in shown
order. Real backends ignore it; the simulated citer needs it (it cites from gold evidence, which no
prompt text carries), so no backend ever has to read memories back out of a prompt.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from rmm.errors import LLMError
from rmm.types import Memory, Message

__all__ = ["LLM", "Message", "Shown", "Usage", "check_batch", "check_shown"]

Shown = Sequence[Sequence[Memory]]
"""Per conversation of a batch, the memories its prompt showed (in shown order)."""

_ROLES = frozenset({"system", "user", "assistant"})


@dataclass
class Usage:
    """What calls cost so far: reported per session of prospective reflection and per question."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: Usage) -> None:
        self.calls += other.calls
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.seconds += other.seconds

    @property
    def tokens_per_second(self) -> float:
        """Completion tokens per second of wall time (0 when nothing was timed)."""
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


class LLM(ABC):
    """A chat model. `generate` keeps the batch's order; `usage` accumulates across calls."""

    name: str
    # Backends that read `shown=` (the simulated citer) set this; the others never receive it.
    reads_shown: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.usage = Usage()
        self._usage_lock = threading.Lock()

    def _record(self, usage: Usage) -> None:
        with self._usage_lock:
            self.usage.add(usage)

    def generate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                 temperature: float = 0.0, shown: Shown | None = None) -> list[str]:
        """One reply per conversation, in the batch's order.

        `json_schema` asks for a JSON object matching it: enforced by constrained decoding where
        the backend has it (OpenAI-compatible servers, vLLM), only requested in the prompt
        elsewhere (transformers) — so callers always parse tolerantly. `shown`: see the module
        docstring.
        """
        options = self._options(batch, json_schema, max_tokens, temperature, shown)
        return self._generate(batch, **options) if batch else []

    async def agenerate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                        temperature: float = 0.0, shown: Shown | None = None) -> list[str]:
        """`generate` for callers on an event loop (e.g. a trainer keeping many requests in flight).

        By default the blocking `generate` runs in a worker thread; backends that speak asyncio
        natively (the OpenAI-compatible client) override it.
        """
        return await asyncio.to_thread(self.generate, batch, json_schema=json_schema, max_tokens=max_tokens,
                                       temperature=temperature, shown=shown)

    def _options(self, batch: list[list[Message]], json_schema: dict | None, max_tokens: int, temperature: float,
                 shown: Shown | None) -> dict[str, Any]:
        """Validate a request; the keyword arguments `_generate` takes for it."""
        check_batch(batch, max_tokens, temperature, json_schema)
        check_shown(shown, len(batch))
        options: dict[str, Any] = {"json_schema": json_schema, "max_tokens": max_tokens, "temperature": temperature}
        if self.reads_shown:
            options["shown"] = shown
        return options

    @abstractmethod
    def _generate(
        self,
        batch: list[list[Message]],
        *,
        json_schema: dict | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
    ) -> list[str]:
        """The backend's work on a validated, non-empty batch."""

    def close(self) -> None:
        """Release connections or models (no-op by default)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_batch(
    batch: Sequence[Sequence[Message]], max_tokens: int, temperature: float, json_schema: dict | None
) -> None:
    """Reject malformed requests before they reach a backend, with a message that says why."""
    if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)):
        raise LLMError(f"batch must be a list of conversations, got {type(batch).__name__}")
    for i, conversation in enumerate(batch):
        if not isinstance(conversation, Sequence) or isinstance(conversation, (str, bytes)) or not conversation:
            raise LLMError(f"conversation {i} must be a non-empty list of messages")
        for message in conversation:
            if (
                not isinstance(message, dict)
                or message.get("role") not in _ROLES
                or not isinstance(message.get("content"), str)
            ):
                raise LLMError(
                    f"conversation {i}: each message must be {{'role': one of {sorted(_ROLES)}, "
                    f"'content': str}}, got {message!r:.120}"
                )
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise LLMError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise LLMError(f"temperature must be a non-negative number, got {temperature!r}")
    if json_schema is not None and not isinstance(json_schema, dict):
        raise LLMError(f"json_schema must be a dict (a JSON schema), got {type(json_schema).__name__}")


def check_shown(shown: Shown | None, n_conversations: int) -> None:
    """`shown` must give one list of memories per conversation of the batch."""
    if shown is None:
        return
    if not isinstance(shown, Sequence) or isinstance(shown, (str, bytes)) or len(shown) != n_conversations:
        raise LLMError(f"shown must hold one list of memories per conversation ({n_conversations}), got {shown!r:.120}")
    for i, memories in enumerate(shown):
        if not isinstance(memories, Sequence) or not all(isinstance(m, Memory) for m in memories):
            raise LLMError(f"shown[{i}] must be a list of Memory records, got {memories!r:.120}")
