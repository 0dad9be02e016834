"""The Semantic XPath query prompt (`xpath_query.txt`): the LLM writes a query from the question and
the tree's schema Σ; a parse error is shown back to it once; a tolerant reader takes the query out
of its reply.

The paper (Liu et al.) publishes no prompt; ours gives Σ as `rmm.memory.tree.Schema.describe`
writes it (types with node counts, attributes, parent → child types), the grammar in a few lines,
example queries built for *this* tree (`example_queries`), and one worked exchange. The reply is one
line ``Query: <query>``; `parse_query_reply` also accepts the query alone, in backticks or a code
fence, and takes the first line that starts with ``/`` when there is no ``Query:`` line. It checks
only that there is something query-shaped: the grammar is `rmm.memory.xpath_syntax.parse`'s job,
whose error (with its column) is what `retry_messages` shows the model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rmm.prompts.goal_render import _messages
from rmm.prompts.parse import PromptParseError
from rmm.types import Message

__all__ = ["MAX_QUERY_CHARS", "example_queries", "parse_query_reply", "retry_messages", "xpath_query_messages"]

MAX_QUERY_CHARS = 2000  # longer replies are runaway generations, not queries
_TOPIC = "a trip to the beach"  # the example queries' match text: generic, so no example answers the question


def example_queries(leaf: str, parent: str | None, parent_attributes: Sequence[str] = ()) -> list[str]:
    """A few queries for a tree whose answers are `leaf` nodes under `parent` nodes (None: under the root)."""
    match = f'[node~"{_TOPIC}"]'
    if parent is None:
        return [f"//{leaf}{match}", f"//{leaf}[-3:-1]{match}"]
    out = [f"//{leaf}{match}", f"//{parent}[max(/{leaf}{match})]/{leaf}{match}",
           f"//{parent}[-1]/{leaf}{match}"]
    if "date" in parent_attributes:
        out.append(f'//{parent}[date~"May 2023"]/{leaf}{match}')
    return out


def xpath_query_messages(question: str, schema: str, examples: Sequence[str]) -> list[Message]:
    """The query-writing prompt: instructions, one worked exchange, then this tree and question."""
    return _messages("xpath_query", schema=schema.strip() or "(root) -> (empty)",
                     examples="\n".join(examples) or "(none)", question=" ".join(question.split()))


def retry_messages(messages: list[Message], reply: str, error: str) -> list[Message]:
    """The same conversation, the model's reply, and the parser's message: one chance to fix it."""
    return [*messages, {"role": "assistant", "content": reply.strip() or "(empty reply)"},
            {"role": "user", "content": f"That query cannot be read: {error}. Reply with the corrected query "
                                        "only, as one line: Query: <the query>"}]


_FENCE = re.compile(r"```[a-zA-Z]*\n?(.*?)```", re.DOTALL)
_LINE = re.compile(r"^\s*(?:[-*]\s+)?\**\s*query\s*\**\s*:\s*\**\s*(.*)$", re.IGNORECASE | re.MULTILINE)


def parse_query_reply(raw: str) -> str:
    """The query text in the model's reply, or `PromptParseError` when there is none."""
    if not isinstance(raw, str) or not raw.strip():
        raise PromptParseError("empty reply: no query")
    text = raw.strip()
    fenced = _FENCE.search(text)
    if fenced and fenced.group(1).strip():
        text = fenced.group(1).strip()
    found = _LINE.search(text)
    if found and found.group(1).strip():
        query = found.group(1).strip()
    else:
        starts = [line.strip() for line in text.splitlines() if line.strip().lstrip("`'\"").startswith("/")]
        if not starts:
            raise PromptParseError(f"no line starting with 'Query:' or '/' in the reply {raw.strip()[:80]!r}")
        query = starts[0]
    query = _unwrap(query)
    if not query:
        raise PromptParseError("the 'Query:' line is empty")
    if len(query) > MAX_QUERY_CHARS:
        raise PromptParseError(f"a query of {len(query)} characters (at most {MAX_QUERY_CHARS})")
    return query


def _unwrap(query: str) -> str:
    """Strip what chat models wrap a one-line answer in: backticks, a pair of outer quotes."""
    query = query.strip().strip("`").strip()
    if len(query) >= 2 and query[0] == query[-1] and query[0] in "'\"" and query[1:2] == "/":
        query = query[1:-1].strip()
    return query
