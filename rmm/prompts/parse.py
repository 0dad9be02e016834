"""Tolerant parsers for LLM outputs: return what can be trusted, record what was dropped.

LLMs (small ones especially) wrap JSON in code fences and chatter, use single quotes or
trailing commas, leave fields out, and write action lines loosely. Each parser here accepts what
it cheaply can, skips what it cannot (with a warning on the result), and raises
`PromptParseError` only when nothing usable is there at all — so a caller can fall back.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rmm.errors import RmmError

__all__ = [
    "ExtractedMemory",
    "ExtractionResult",
    "PromptParseError",
    "UpdateAction",
    "UpdateResult",
    "parse_extraction",
    "parse_judge",
    "parse_update",
]

log = logging.getLogger(__name__)

_MAX_STARTS = 64
_MAX_CANDIDATE = 50_000
_MAX_WARNINGS = 20
_MAX_DEPTH = 4

# Summaries from the templates' worked examples: small models sometimes copy them verbatim, and
# storing "Maya signed up for a pottery class" as a fact about the user would be invented memory.
EXAMPLE_SUMMARIES = frozenset({
    (
        "maya signed up for a pottery class downtown on fifth street, inspired by her grandmother's pottery "
        "wheel from her childhood."
    ),
    "maya lives in a flat a ten-minute walk from the pottery class downtown.",
    "sam plays tennis every tuesday and friday, although he finds it boring.",
})
_EXAMPLE_NAMES = re.compile(r"\b(?:Maya|Sam)\b")


class PromptParseError(RmmError, ValueError):
    """An LLM output with nothing usable in the expected format (the caller falls back)."""


@dataclass
class ExtractedMemory:
    summary: str
    refs: list[str]


@dataclass
class UpdateAction:
    kind: Literal["add", "merge"]
    index: int | None = None
    summary: str | None = None


class _Warned(list):  # type: ignore[type-arg]
    """A list that also carries what the parser dropped or repaired."""

    def __init__(self, items: Any = (), warnings: list[str] | None = None) -> None:
        super().__init__(items)
        self.warnings: list[str] = warnings if warnings is not None else []


class ExtractionResult(_Warned):
    """`list[ExtractedMemory]` with `.warnings`."""


class UpdateResult(_Warned):
    """`list[UpdateAction]` with `.warnings`."""


def _warn(warnings: list[str], message: str) -> None:
    if len(warnings) < _MAX_WARNINGS:
        log.debug("prompt parse: %s", message)
        warnings.append(message)
    elif len(warnings) == _MAX_WARNINGS:
        warnings.append("further warnings suppressed")


def _require_text(text: object) -> str:
    if not isinstance(text, str):
        raise PromptParseError(f"expected the LLM output as a string, got {type(text).__name__}")
    return text


# -- JSON found amid chatter ------------------------------------------------------------------
_FENCE = re.compile(r"```[A-Za-z]*[ \t]*\n?(.*?)```", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_PY_LITERALS = {"true": "True", "false": "False", "null": "None"}
_BARE_WORD = re.compile(r"\b(true|false|null)\b")


def _balanced(text: str, start: int) -> str | None:
    """The bracketed span starting at `start` (string-aware, both quote kinds), or None."""
    depth, quote, escaped = 0, "", False
    stop = min(len(text), start + _MAX_CANDIDATE)
    for i in range(start, stop):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
            if depth < 0:
                return None
    return None


def _loads(candidate: str) -> Any:
    """JSON, else JSON without trailing commas, else a Python literal (single quotes); or None."""
    for attempt in (candidate, _TRAILING_COMMA.sub(r"\1", candidate)):
        try:
            return json.loads(attempt)
        except (ValueError, RecursionError):
            pass
    try:
        python = _BARE_WORD.sub(lambda m: _PY_LITERALS[m.group(1)], candidate)
        value = ast.literal_eval(python)
    except Exception:  # noqa: BLE001 — literal_eval raises SyntaxError, ValueError, MemoryError, RecursionError…
        return None
    return value if isinstance(value, (dict, list)) else None


def _json_values(text: str) -> list[Any]:
    """Every JSON-ish object or list in the text: fenced blocks first, then embedded ones."""
    values: list[Any] = []
    for match in _FENCE.finditer(text):
        value = _loads(match.group(1).strip())
        if value is not None:
            values.append(value)
    position, starts = 0, 0
    while starts < _MAX_STARTS:
        found = [i for i in (text.find("{", position), text.find("[", position)) if i >= 0]
        if not found:
            break
        start = min(found)
        starts += 1
        span = _balanced(text, start)
        value = _loads(span) if span is not None else None
        if value is not None:
            values.append(value)
            position = start + len(span)  # type: ignore[arg-type]
        else:
            position = start + 1
    return values


# -- extraction ---------------------------------------------------------------------------------
_NO_TRAIT = re.compile(r"NO[\s_-]?TRAITS?", re.IGNORECASE)
_LIST_KEYS = ("extracted_memories", "extracted_memory", "memories", "summaries")
_SUMMARY_KEYS = ("summary", "memory", "text", "content")
_REF_KEYS = ("reference", "references", "refs", "ref", "turns", "turn_ids", "turn_id")
_TURN_REF = re.compile(r"\s*\[?\s*(?:turn\s*)?#?\s*(\d{1,9})\s*\]?\s*", re.IGNORECASE)


def _memory_list(value: Any) -> list[Any] | None:
    """The list of extracted items in a parsed JSON value, if it is shaped like one."""
    if isinstance(value, dict):
        for key in _LIST_KEYS:
            if key in value:
                items = value[key]
                if isinstance(items, list):
                    return items
                if isinstance(items, dict):
                    return [items]
                return []  # "NO_TRAIT", null, "" — nothing extracted
        if any(k in value for k in _SUMMARY_KEYS):
            return [value]
        return None
    is_items = isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
    if is_items and any(any(k in v for k in _SUMMARY_KEYS) for v in value):
        return value
    return None


def _refs(raw: Any, turn_ids: list[str], valid: set[str], warnings: list[str], depth: int = 0) -> list[str]:
    if raw is None:
        return []
    if depth > _MAX_DEPTH:
        _warn(warnings, "dropped a too deeply nested reference")
        return []
    if isinstance(raw, (list, tuple)):
        return [r for item in raw for r in _refs(item, turn_ids, valid, warnings, depth + 1)]
    if isinstance(raw, bool):
        _warn(warnings, f"dropped reference {raw!r}")
        return []
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, int):
        if 0 <= raw < len(turn_ids):
            return [turn_ids[raw]]
        _warn(warnings, f"dropped reference to turn {raw} (the session has {len(turn_ids)} turns)")
        return []
    if isinstance(raw, str):
        if raw in valid:
            return [raw]
        if raw.strip() in valid:
            return [raw.strip()]
        match = _TURN_REF.fullmatch(raw)
        if match:
            return _refs(int(match.group(1)), turn_ids, valid, warnings, depth + 1)
        if "," in raw and depth < _MAX_DEPTH:
            return _refs(raw.strip().strip("[]").split(","), turn_ids, valid, warnings, depth + 1)
    _warn(warnings, f"dropped unknown reference {str(raw)[:40]!r}")
    return []


def parse_extraction(text: str, valid_turn_ids: Sequence[str]) -> ExtractionResult:
    """Extracted memories with refs mapped to turn ids; `NO_TRAIT` → [].

    References may be turn numbers as the prompt showed them (indices into `valid_turn_ids`,
    which must be in the prompt's order — `extraction_turn_ids(session)`), or the turn ids
    themselves. Anything else is dropped, never guessed.
    """
    text = _require_text(text)
    turn_ids = [str(t) for t in valid_turn_ids]
    valid = set(turn_ids)
    warnings: list[str] = []
    items: list[Any] | None = None
    for value in _json_values(text):
        items = _memory_list(value)
        if items is not None:
            break
    if items is None:
        items = _salvage_items(text)
        if items:
            _warn(warnings, f"salvaged {len(items)} complete summaries from incomplete JSON")
    if items is None:
        if _NO_TRAIT.search(text):
            return ExtractionResult([], warnings)
        raise PromptParseError(
            f"no extracted_memories JSON and no NO_TRAIT in the output: {text[:120]!r}"
        )
    result = ExtractionResult([], warnings)
    orphan_target: int | None = None  # the last kept memory, while it has no reference yet
    for item in items:
        if isinstance(item, str):
            summary, raw_refs = item, None
        elif isinstance(item, dict):
            summary = next((item[k] for k in _SUMMARY_KEYS if isinstance(item.get(k), str)), None)
            raw_refs = next((item[k] for k in _REF_KEYS if k in item), None)
        else:
            _warn(warnings, f"skipped an item that is not an object: {str(item)[:40]!r}")
            continue
        if summary is None or not summary.strip() or _NO_TRAIT.fullmatch(summary.strip()):
            if raw_refs is not None and orphan_target is not None:
                # `{"summary": s}, {"reference": [..]}` — the model split one item in two
                result[orphan_target].refs = list(dict.fromkeys(_refs(raw_refs, turn_ids, valid, warnings)))
                orphan_target = None
                continue
            _warn(warnings, "skipped an item without a summary")
            continue
        if _is_example_copy(summary):
            _warn(warnings, f"dropped a copy of the prompt's example: {summary.strip()[:40]!r}")
            continue
        refs = list(dict.fromkeys(_refs(raw_refs, turn_ids, valid, warnings)))
        if not refs:
            _warn(warnings, f"memory {summary.strip()[:40]!r} has no valid turn reference")
        summary = " ".join(summary.split())
        repeated = next((m for m in result if m.summary.lower() == summary.lower()), None)
        if repeated is not None:  # small models loop; one memory per fact, with every turn it cited
            repeated.refs = list(dict.fromkeys(repeated.refs + refs))
            _warn(warnings, f"merged a repeated summary: {summary[:40]!r}")
            orphan_target = None
            continue
        result.append(ExtractedMemory(summary=summary, refs=refs))
        orphan_target = len(result) - 1 if not refs and raw_refs is None else None
    return result


_SALVAGE = re.compile(
    r'"summary"\s*:\s*"((?:[^"\\]|\\.){1,2000})"(?:\s*,\s*"references?"\s*:\s*\[([^\[\]]{0,200})\])?'
)


def _salvage_items(text: str) -> list[Any] | None:
    """Complete `"summary": "…"` pairs of a reply cut off mid-JSON (e.g. at max_tokens)."""
    if "summary" not in text:
        return None
    items: list[Any] = []
    for match in _SALVAGE.finditer(text):
        try:
            summary = json.loads('"' + match.group(1) + '"')
        except (ValueError, RecursionError):
            continue
        refs = _loads("[" + match.group(2) + "]") if match.group(2) is not None else None
        items.append({"summary": summary, "reference": refs})
    return items or None


def _is_example_copy(summary: str) -> bool:
    normalized = " ".join(summary.split()).lower()
    if normalized in EXAMPLE_SUMMARIES:
        return True
    # near copies: the example's person and most of its words
    if not _EXAMPLE_NAMES.search(summary):
        return False
    words = set(re.findall(r"[a-z]+", normalized))
    return any(len(words & set(re.findall(r"[a-z]+", e))) >= 0.8 * len(set(re.findall(r"[a-z]+", e)))
               for e in EXAMPLE_SUMMARIES)


# -- update -----------------------------------------------------------------------------------
_ACTION = re.compile(r"(?<![A-Za-z])(add|merge)\s*\(", re.IGNORECASE)
_BARE_ADD = re.compile(r"[\W_]*(?:action\s*:\s*)?add[\W_]*", re.IGNORECASE)
_MERGE_ARGS = re.compile(
    r"\s*(?:index\s*[=:]\s*)?[\[\"']?\s*([+-]?\d{1,9})\s*[\]\"']?\s*[,;:]\s*(.*)", re.DOTALL | re.IGNORECASE
)
_ECHOED_HEADER = re.compile(r"\s*(?:existing notes|new note|example)\s*:", re.IGNORECASE)
_SUMMARY_LABEL = re.compile(r"^(?:merged_summary|summary)\s*[=:]\s*", re.IGNORECASE)
_QUOTES = "\"'“”‘’`"


def _clean_summary(raw: str) -> str:
    summary = _SUMMARY_LABEL.sub("", raw.strip())
    summary = summary.strip()
    if len(summary) >= 2 and summary[0] in _QUOTES and summary[-1] in _QUOTES:
        summary = summary[1:-1]
    return " ".join(summary.split())


def _logical_lines(text: str) -> list[str]:
    """Lines, with a Merge( whose closing parenthesis is on a later line joined to it."""
    lines: list[str] = []
    pending = ""
    for line in text.replace("```", "\n").splitlines():
        if pending:
            pending += " " + line.strip()
            if ")" in line:
                lines.append(pending)
                pending = ""
            continue
        match = _ACTION.search(line)
        if match and match.group(1).lower() == "merge" and ")" not in line[match.end():]:
            pending = line
            continue
        lines.append(line)
    if pending:
        lines.append(pending)
    return lines


def parse_update(text: str, n_existing: int) -> UpdateResult:
    """`Add()` / `Merge(index, merged_summary)` actions; bad lines skipped, bad indices dropped.

    Raises PromptParseError only when no action line is there at all.
    """
    text = _require_text(text)
    if isinstance(n_existing, bool) or not isinstance(n_existing, int) or n_existing < 0:
        raise PromptParseError(f"n_existing must be a non-negative int, got {n_existing!r}")
    warnings: list[str] = []
    result = UpdateResult([], warnings)
    recognised = False
    for line in _logical_lines(text):
        if recognised and _ECHOED_HEADER.match(line):
            _warn(warnings, "ignored what follows an echoed prompt header (the model went on with a new case)")
            break
        matches = list(_ACTION.finditer(line))
        if not matches:
            if _BARE_ADD.fullmatch(line) and line.strip():
                recognised = True
                result.append(UpdateAction("add"))
            continue
        for i, match in enumerate(matches):
            recognised = True
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            segment = line[match.end() : end]
            if match.group(1).lower() == "add":
                result.append(UpdateAction("add"))
                continue
            close = segment.rfind(")")
            if close < 0:
                _warn(warnings, f"Merge without closing parenthesis: {line.strip()[:60]!r}")
            args = segment[:close] if close >= 0 else segment
            parsed = _MERGE_ARGS.fullmatch(args)
            if parsed is None:
                _warn(warnings, f"skipped malformed Merge: {line.strip()[:60]!r}")
                continue
            index, summary = int(parsed.group(1)), _clean_summary(parsed.group(2))
            if not 0 <= index < n_existing:
                _warn(warnings, f"dropped Merge into index {index} (only {n_existing} memories shown)")
                continue
            if not summary:
                _warn(warnings, f"dropped Merge({index}) without a merged summary")
                continue
            if _is_example_copy(summary):
                _warn(warnings, f"dropped Merge({index}) copying the prompt's example")
                continue
            result.append(UpdateAction("merge", index, summary))
    if not recognised:
        raise PromptParseError(f"no Add() or Merge(index, summary) line in the output: {text[:120]!r}")
    return result


# -- judge ------------------------------------------------------------------------------------
_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|true|false)\b", re.IGNORECASE)
_POSITIVE = {"yes", "correct", "true"}


def parse_judge(text: str) -> bool | None:
    """Yes → True, No → False (the first verdict word wins); None when there is none."""
    text = _require_text(text)
    match = _VERDICT.search(text)
    if match is None:
        return None
    return match.group(1).lower() in _POSITIVE
