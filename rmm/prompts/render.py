"""Filling the prompt templates (and reading back the memory list an answer prompt showed)."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from functools import cache
from importlib import resources

from rmm.policy.citations import parse_citations, parse_json_citations
from rmm.prompts.parse import PromptParseError
from rmm.types import Memory, Message, Session, Turn

__all__ = [
    "few_shot_messages",
    "ANSWER_SCHEMA",
    "EXTRACTION_SCHEMA",
    "answer_messages",
    "extraction_messages",
    "extraction_turn_ids",
    "is_answer_prompt",
    "judge_messages",
    "load_template",
    "normalize_memory_text",
    "parse_shown_memories",
    "update_messages",
]

ANSWER_SCHEMA: dict = {
    "title": "answer_with_citations",
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "citations": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
    "required": ["answer", "citations"],
    "additionalProperties": False,
}

EXTRACTION_SCHEMA: dict = {
    "title": "extracted_memories",
    "type": "object",
    "properties": {
        "extracted_memories": {
            "type": "array",
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    # Bounds let constrained decoding close the JSON: a looping small model would
                    # otherwise run into max_tokens mid-string and leave nothing parseable.
                    "summary": {"type": "string", "maxLength": 300},
                    "reference": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 20},
                },
                "required": ["summary", "reference"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["extracted_memories"],
    "additionalProperties": False,
}

_MEMORIES_HEADER = "\nMemories:\n"
_MEMORY_LINE = "- Memory ["
_CONTINUATION = "  "
_ORIGINAL = "  Original turns:"
_NO_MEMORIES = "(none)"
_QUERY_LINE = "\nMy message: "


@cache
def load_template(name: str) -> string.Template:
    """A template of this package by file stem (`extraction`, `update`, `answer`, …)."""
    try:
        text = resources.files("rmm.prompts").joinpath(f"{name}.txt").read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise ValueError(f"no prompt template named {name!r}") from error
    return string.Template(text)


_FEW_SHOT = ("@@EXAMPLE@@\n", "@@EXAMPLE_OUTPUT@@\n", "@@INPUT@@\n")


def few_shot_messages(template: str, **values: str) -> list[Message]:
    """A template of instructions, a worked example, its output and the case as chat messages: the
    instructions as the system message, the example as a user/assistant exchange, then the case
    (filled from `values`).

    Small chat models copy the format of an assistant turn far more reliably than that of an
    example written inside the instructions (which they tend to echo or continue).
    """
    example_mark, output_mark, input_mark = _FEW_SHOT
    instructions, _, rest = template.partition(example_mark)
    example, _, rest = rest.partition(output_mark)
    output, _, task = rest.partition(input_mark)
    return [
        {"role": "system", "content": instructions.strip()},
        {"role": "user", "content": example.strip()},
        {"role": "assistant", "content": output.strip()},
        {"role": "user", "content": string.Template(task).substitute(**values).strip() + "\n"},
    ]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


_INPUT_MARKER = "@@INPUT@@\n"


def _messages(name: str, **values: str) -> list[Message]:
    """Instructions and examples as the system message, the case at hand as the user message.

    Small chat models continue an in-prompt example instead of answering when everything is one
    user turn; separating the two roles makes them answer the case at hand far more often.
    """
    instructions, marker, task = load_template(name).template.partition(_INPUT_MARKER)
    if not marker:
        return [{"role": "user", "content": string.Template(instructions).substitute(**values)}]
    return [
        {"role": "system", "content": string.Template(instructions).substitute(**values).strip()},
        {"role": "user", "content": string.Template(task).substitute(**values).strip() + "\n"},
    ]


def extraction_turn_ids(session: Session) -> list[str]:
    """The turn ids in the order the extraction prompt numbers them (pass to parse_extraction)."""
    return [t.id for t in session.turns]


def extraction_messages(session: Session, speaker: str) -> list[Message]:
    """Ask for `speaker`'s personal summaries of one session, turns numbered 0…n-1."""
    if not isinstance(speaker, str) or not speaker.strip():
        raise ValueError(f"speaker must be a non-empty string, got {speaker!r}")
    if not session.turns:
        raise ValueError(f"session {session.id} has no turns to extract from")
    turns = "\n".join(
        f"Turn {i} - {_one_line(t.speaker)}: {_one_line(t.text)}" for i, t in enumerate(session.turns)
    )
    when = f" (held {session.time})" if session.time else ""
    return _messages("extraction", speaker=speaker.strip(), turns=turns, session_time=when)


def update_messages(summary: str, existing: Sequence[Memory]) -> list[Message]:
    """Ask whether `summary` adds a new memory or merges into one of `existing` (indexed 0…)."""
    history = json.dumps([m.text for m in existing], ensure_ascii=False)
    return _messages("update", history=history, new=json.dumps(summary, ensure_ascii=False))


def normalize_memory_text(text: str) -> str:
    """A memory text as the answer prompt shows it (line breaks normalised): compare with this."""
    return "\n".join(text.splitlines())


def _render_memory(index: int, memory: Memory) -> str:
    lines = memory.text.splitlines() or [""]
    rendered = [f"{_MEMORY_LINE}{index}]: {lines[0]}"] + [_CONTINUATION + line for line in lines[1:]]
    source = memory.source_text.strip()
    if source and normalize_memory_text(source) != normalize_memory_text(memory.text):
        rendered.append(_ORIGINAL)
        rendered += [f"{_CONTINUATION}| {line}" for line in source.splitlines()]
    return "\n".join(rendered)


def _render_history(history: Sequence[Turn] | None) -> str:
    if not history:
        return ""
    lines = [f"{_one_line(t.speaker)}: {_one_line(t.text)}" for t in history]
    return "\nConversation so far:\n" + "\n".join(lines) + "\n"


def answer_messages(
    query: str,
    memories: Sequence[Memory],
    history: Sequence[Turn] | None = None,
    structured: bool = False,
) -> list[Message]:
    """Answer `query` from the shown memories, citing them by position (0-based, shown order).

    `structured=True` asks for `{"answer", "citations"}` — send it with `json_schema=ANSWER_SCHEMA`.
    """
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, got {type(query).__name__}")
    rendered = "\n".join(_render_memory(i, m) for i, m in enumerate(memories)) or _NO_MEMORIES
    return _messages("answer_structured" if structured else "answer", history=_render_history(history),
                     query=_one_line(query), memories=rendered)


def judge_messages(question: str, gold_answer: str, prediction: str) -> list[Message]:
    """App. D.3: does the prediction answer the question as the gold answer does? (Yes / No)."""
    return _messages("judge", question=_one_line(question), answer=_one_line(str(gold_answer)),
                     response=_one_line(prediction))


def _answer_section(conversation: Sequence[Message]) -> str | None:
    """The memory list of an answer prompt's user message (None for any other prompt).

    The query and history are rendered on single lines, so only the real header starts a line
    with `Memories:`; the list ends at the first line that is neither an entry nor indented.
    """
    for message in reversed(conversation):
        if message.get("role") == "user":
            content = "\n" + message.get("content", "")
            at = content.rfind(_MEMORIES_HEADER)
            if at >= 0 and _QUERY_LINE in content[at:]:
                return content[at + len(_MEMORIES_HEADER):]
            return None
    return None


_EXAMPLE_REPLY = re.compile(r"^Reply: (.+)$", re.MULTILINE)


def _answer_key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


@cache
def example_answers() -> frozenset[str]:
    """The answers of the answer templates' worked examples, normalised (read from the files)."""
    answers = set()
    for name, parse in (("answer", parse_citations), ("answer_structured", parse_json_citations)):
        examples = load_template(name).template.partition(_INPUT_MARKER)[0]
        shown = examples.count(_MEMORY_LINE.strip())  # every index an example cites is below this
        answers.update(_answer_key(parse(reply, shown).answer) for reply in _EXAMPLE_REPLY.findall(examples))
    return frozenset(a for a in answers if a)


def is_example_answer(answer: str) -> bool:
    """Whether a reply copies a worked example's answer (small models do) instead of answering.

    Its citations then point at the example's memory numbers, not at anything the reply used, so
    they must not become rewards.
    """
    key = _answer_key(answer)
    return bool(key) and any(example in key for example in example_answers())


def is_answer_prompt(conversation: Sequence[Message]) -> bool:
    return _answer_section(conversation) is not None


def parse_shown_memories(conversation: Sequence[Message]) -> list[str]:
    """The memory texts an `answer_messages` prompt showed, in shown order (normalised text).

    For stand-ins that only see the prompt (scripted test LLMs); backends get the memories
    themselves as `LLM.generate(…, shown=…)` and never parse them back out of text.
    """
    section = _answer_section(conversation)
    if section is None:
        raise PromptParseError("not an answer prompt: no memory list followed by the user's message")
    texts: list[str] = []
    in_original = False
    for line in section.split("\n"):
        if line.startswith(_MEMORY_LINE):
            head, sep, rest = line.partition("]: ")
            if not sep or not head[len(_MEMORY_LINE):].isdigit() or int(head[len(_MEMORY_LINE):]) != len(texts):
                raise PromptParseError(f"memory list out of order at {line[:60]!r}")
            texts.append(rest)
            in_original = False
        elif line == _ORIGINAL and texts:
            in_original = True
        elif line.startswith(_CONTINUATION) and texts:
            if not in_original:
                texts[-1] += "\n" + line[len(_CONTINUATION):]
        else:
            break
    return texts
