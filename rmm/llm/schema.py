"""Asking for JSON in the prompt, for backends without constrained decoding (transformers, or an
OpenAI-compatible server used with `structured="prompt"`)."""

from __future__ import annotations

import json

from rmm.llm.base import Message

__all__ = ["schema_instruction", "with_schema_instruction"]


def schema_instruction(json_schema: dict) -> str:
    """The request for JSON that backends without constrained decoding add to the prompt."""
    return (
        "\n\nRespond with only a JSON object (no code fence, no other text) that matches this "
        f"JSON schema:\n{json.dumps(json_schema)}"
    )


def with_schema_instruction(conversation: list[Message], json_schema: dict) -> list[Message]:
    """The conversation with the JSON request appended to its last user message."""
    messages = [dict(m) for m in conversation]
    for message in reversed(messages):
        if message["role"] == "user":
            message["content"] += schema_instruction(json_schema)
            return messages
    return messages + [{"role": "user", "content": schema_instruction(json_schema).strip()}]
