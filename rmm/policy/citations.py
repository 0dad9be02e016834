"""Reading the generator's citations (paper §6.2, App. D.2) — robustly, never raising.

The paper's prompt asks for the answer followed by the indices of the memories used, `… [0, 2]`,
or `[NO_CITE]` when none helped. Under structured decoding the answer is a JSON object
`{"answer": str, "citations": [int]}`. LLM output is messy, so the rules are:

* A *citation marker* is a bracket holding only integers (`[0, 2]`, `[1]`, `[0,1, and 2]`,
  `[Memory 0, Memory 2]`, `[]`; also `\\[0\\]` escaped and full-width brackets) or `[NO_CITE]`
  (any case, `_`/space/`-`, or bare `NO_CITE`). Brackets with anything else (`[laughs]`,
  `[simulated answer]`) are answer text.
* The **last** marker wins — the paper's format puts the list at the end. When it ends the text
  (only whitespace, punctuation or markdown after it), adjacent markers before it that are
  separated only by commas/whitespace/markdown join it, so `… [0] [2]` and `**[0], [2]**` both
  give `[0, 2]`. Earlier, mid-text integer lists (`the codes [1, 2, 3] …`) are answer text.
  When the last marker is followed by more prose, it is still used, with a warning.
* Exception, the inline style the prompt's "cite using [i]" invites (`hiking [0] and guitar
  [1].`): when *every* marker is a single in-range index and the last one ends the reply, all of
  them count.
* Indices outside `[0, n_shown)`, negative or repeated are dropped (logged and recorded in
  `warnings`). If a list had indices but none survived, `cited` is None: nothing usable was
  cited, which is not the same as citing nothing, so the learner skips rather than punishes.
* `cited=None` means no parseable citation at all (→ the learner skips the query);
  `no_cite=True` (with `cited=[]`) means the model said no memory helped (→ all shown get −1).
  An explicit empty list (`[]`, `"citations": []`) counts as `no_cite`.
* `parse_citations` also reads a JSON reply (it tries JSON first when the text mentions
  "citation"); `parse_json_citations` reads JSON and falls back to free text with a warning.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Citation", "format_response", "parse_citations", "parse_json_citations"]

log = logging.getLogger(__name__)

_BRACKETS = str.maketrans({"［": "[", "］": "]", "【": "[", "】": "]"})
_BRACKET = re.compile(r"\[([^\[\]\n]{0,200})\]")
_BARE_NO_CITE = re.compile(r"\bNO_CITE\b")
_NO_CITE_INNER = re.compile(r"\s*no[\s_-]*cite\s*", re.IGNORECASE)
_ITEM_PREFIX = re.compile(r"\b(?:memory|memories|mem)\b\s*#?\s*|#\s*", re.IGNORECASE)
_ITEM_SPLIT = re.compile(r"[\s,;]+|\band\b", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?\d+")
_JOINER = re.compile(r"[\s,;*_`~]*(?:and)?[\s,;*_`~]*", re.IGNORECASE)
_TRAILER = re.compile(r"[\s\W_]*")
_LABEL = re.compile(
    r"(?<!\w)\**\s*(?:citations?|cited(?:\s+memories)?|sources?|references?|memories\s+used)"
    r"\s*\**\s*[:：]\s*\**\s*$",
    re.IGNORECASE,
)
_MARKUP = "*_`~"
_OPENING_MARKUP = re.compile(r"(^|\s)[*_`~]+\s*$")
_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_MAX_DIGITS = 9  # int() of a huge digit string is slow or raises; such an index is out of range anyway
_MAX_JSON_STARTS = 256
_MAX_WARNINGS = 20


@dataclass
class Citation:
    """The answer text and which shown memories (0-based, in shown order) it cites."""

    answer: str
    cited: list[int] | None
    no_cite: bool = False
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Marker:
    start: int
    end: int
    indices: list[str] | None  # raw integer tokens; None for NO_CITE


def format_response(answer: str, cited: list[int] | None) -> str:
    """Write an answer in the paper's free-text format (what `parse_citations` reads back)."""
    tail = "[NO_CITE]" if not cited else "[" + ", ".join(str(int(i)) for i in cited) + "]"
    return f"{answer.rstrip()} {tail}".lstrip()


def _warn(warnings: list[str], message: str) -> None:
    if len(warnings) < _MAX_WARNINGS:
        log.warning("citation parse: %s", message)
        warnings.append(message)
    elif len(warnings) == _MAX_WARNINGS:
        warnings.append("further warnings suppressed")


def _integer_tokens(inner: str) -> list[str] | None:
    """The integer tokens of a bracket's content, or None when it holds anything else."""
    stripped = _ITEM_PREFIX.sub(" ", inner)
    tokens = [t for t in _ITEM_SPLIT.split(stripped) if t]
    if not tokens and inner.strip(" ,;"):
        return None  # e.g. "[memory]" — words only
    if all(_INTEGER.fullmatch(t) for t in tokens):
        return tokens
    return None


def _markers(text: str) -> list[_Marker]:
    found: list[_Marker] = []
    for match in _BRACKET.finditer(text):
        inner = match.group(1)
        if _NO_CITE_INNER.fullmatch(inner):
            found.append(_Marker(match.start(), match.end(), None))
            continue
        tokens = _integer_tokens(inner)
        if tokens is not None:
            found.append(_Marker(match.start(), match.end(), tokens))
    bracketed = [(m.start, m.end) for m in found]  # already in text order
    for match in _BARE_NO_CITE.finditer(text):
        i = bisect.bisect_right(bracketed, (match.start(), len(text) + 1)) - 1
        if i < 0 or not bracketed[i][0] <= match.start() < bracketed[i][1]:
            found.append(_Marker(match.start(), match.end(), None))
    found.sort(key=lambda m: m.start)
    return found


def _join_answer(left: str, right: str, at_end: bool) -> str:
    """The reply without its citation marker, minus markup and labels that only framed it."""
    trimmed = _OPENING_MARKUP.sub(r"\1", left)
    if at_end or trimmed != left:  # markup that wrapped the marker closes right after it
        right = right.lstrip(_MARKUP + " \t") if not at_end else "".join(
            ch for ch in right if ch not in _MARKUP
        )
    left = _LABEL.sub("", trimmed.rstrip()).rstrip()
    right = right.strip()
    if not right or not left:
        return (left or right).strip()
    if right[0] in ".,;:!?)":
        return left + right
    return f"{left} {right}"


def _valid_indices(tokens: list[str], n_shown: int, warnings: list[str]) -> list[int]:
    cited: list[int] = []
    for token in tokens:
        digits = token.lstrip("+-")
        if token.startswith("-") and digits.strip("0"):
            _warn(warnings, f"dropped negative index {token}")
            continue
        if len(digits.lstrip("0")) > _MAX_DIGITS:
            _warn(warnings, f"dropped out-of-range index {token[:20]}… (n_shown={n_shown})")
            continue
        index = int(digits)
        if index >= n_shown:
            _warn(warnings, f"dropped out-of-range index {index} (n_shown={n_shown})")
        elif index in cited:
            _warn(warnings, f"dropped duplicate index {index}")
        else:
            cited.append(index)
    return cited


def _finish(answer: str, tokens: list[str], n_shown: int, warnings: list[str]) -> Citation:
    if not tokens:
        return Citation(answer=answer, cited=[], no_cite=True, warnings=warnings)
    cited = _valid_indices(tokens, n_shown, warnings)
    if not cited:
        _warn(warnings, "no valid index among the cited ones; treating the citation as unparseable")
        return Citation(answer=answer, cited=None, no_cite=False, warnings=warnings)
    return Citation(answer=answer, cited=cited, no_cite=False, warnings=warnings)


def _check_n_shown(n_shown: int) -> None:
    if not isinstance(n_shown, int) or isinstance(n_shown, bool) or n_shown < 0:
        raise ValueError(f"n_shown must be a non-negative int, got {n_shown!r}")


def parse_citations(text: str, n_shown: int) -> Citation:
    """Parse a generator reply (free text, or a JSON object) into answer + cited indices."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    _check_n_shown(n_shown)
    if "citation" in text or '"cited"' in text:
        parsed = _parse_json(text, n_shown)
        if parsed is not None:
            return parsed
    return _parse_free_text(text, n_shown, [])


def parse_json_citations(text: str, n_shown: int) -> Citation:
    """Parse `{"answer": str, "citations": [int]}` (fenced or amid chatter); else free text."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    _check_n_shown(n_shown)
    parsed = _parse_json(text, n_shown)
    if parsed is not None:
        return parsed
    warnings: list[str] = []
    _warn(warnings, "no JSON object with citations found; parsed as free text")
    return _parse_free_text(text, n_shown, warnings)


def _parse_free_text(text: str, n_shown: int, warnings: list[str]) -> Citation:
    text = text.translate(_BRACKETS).replace("\\[", "[").replace("\\]", "]")
    markers = _markers(text)
    if not markers:
        return Citation(answer=text.strip(), cited=None, no_cite=False, warnings=warnings)
    last = markers[-1]
    block = [last]
    at_end = _TRAILER.fullmatch(text, last.end) is not None
    if at_end and last.indices is not None:
        for previous in reversed(markers[:-1]):
            if previous.indices is None or not _JOINER.fullmatch(text, previous.end, block[-1].start):
                break
            block.append(previous)
        block.reverse()
    if not at_end:
        _warn(warnings, "citation marker is not at the end of the reply; using the last one")
    if any(m.indices is None for m in markers[: -len(block)]) and last.indices is not None:
        _warn(warnings, "ignored an earlier [NO_CITE]: a citation list follows it")
    start, end = block[0].start, block[-1].end
    inline = at_end and _inline_style(markers, n_shown)
    left = _strip_markers(text, markers[: -len(block)], start) if inline else text[:start]
    answer = _join_answer(left, text[end:], at_end)
    if last.indices is None:
        if any(m.indices for m in markers[:-1]):
            _warn(warnings, "ignored an earlier citation list: [NO_CITE] follows it")
        return Citation(answer=answer, cited=[], no_cite=True, warnings=warnings)
    if inline:
        block = markers  # "hiking [0] and guitar [1]." — every memory cited where it is used
    tokens = [t for m in block for t in (m.indices or [])]
    result = _finish(answer, tokens, n_shown, warnings)
    if result.cited is None and not at_end:
        result.answer = text.strip()  # the "marker" was probably answer text ("in [2019]")
    return result


def _inline_style(markers: list[_Marker], n_shown: int) -> bool:
    """True when every marker is a single in-range index: the `[i]`-after-each-claim style."""
    if len(markers) < 2:
        return False
    for marker in markers:
        if marker.indices is None or len(marker.indices) != 1:
            return False
        token = marker.indices[0]
        if not token.isdigit() or len(token) > _MAX_DIGITS or int(token) >= n_shown:
            return False
    return True


def _strip_markers(text: str, markers: list[_Marker], stop: int) -> str:
    """`text[:stop]` without the given (inline) markers."""
    pieces: list[str] = []
    position = 0
    for marker in markers:
        pieces.append(text[position : marker.start].rstrip(" \t"))
        position = marker.end
    pieces.append(text[position:stop])
    joined = ""
    for piece in pieces:
        if joined and piece and piece[0] not in ".,;:!?)" and not piece[0].isspace():
            joined += " "
        joined += piece
    return joined


def _json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in the text: fenced blocks first, then ones embedded in chatter."""
    objects: list[dict[str, Any]] = []
    for match in _FENCE.finditer(text):
        try:
            value = json.loads(match.group(1))
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            objects.append(value)
    decoder = json.JSONDecoder()
    position, tries = 0, 0
    while tries < _MAX_JSON_STARTS:
        start = text.find("{", position)
        if start < 0:
            break
        tries += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            position = start + 1
            continue
        if isinstance(value, dict):
            objects.append(value)
        position = max(end, start + 1)
    return objects


_CITATION_KEYS = ("citations", "citation", "cited")
_ANSWER_KEYS = ("answer", "response")


def _parse_json(text: str, n_shown: int) -> Citation | None:
    objects = [o for o in _json_objects(text) if any(k in o for k in _CITATION_KEYS)]
    if not objects:
        return None
    obj = objects[-1]
    warnings: list[str] = []
    raw_answer = next((obj[k] for k in _ANSWER_KEYS if k in obj), "")
    answer = raw_answer if isinstance(raw_answer, str) else json.dumps(raw_answer)
    raw = next(obj[k] for k in _CITATION_KEYS if k in obj)
    if isinstance(raw, str):
        if _NO_CITE_INNER.fullmatch(raw.strip("[] ")):
            return Citation(answer=answer, cited=[], no_cite=True, warnings=warnings)
        tokens = _integer_tokens(raw.strip().strip("[]"))
        if tokens is None:
            _warn(warnings, f"citations field is not a list of indices: {raw[:40]!r}")
            return Citation(answer=answer, cited=None, no_cite=False, warnings=warnings)
        return _finish(answer, tokens, n_shown, warnings)
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list):
        _warn(warnings, f"citations field is {type(raw).__name__}, expected a list of indices")
        return Citation(answer=answer, cited=None, no_cite=False, warnings=warnings)
    tokens: list[str] = []
    for item in raw:
        if isinstance(item, int) and not isinstance(item, bool):
            tokens.append(str(item))
        elif isinstance(item, str) and _INTEGER.fullmatch(item.strip().strip("[]").strip()):
            tokens.append(item.strip().strip("[]").strip())
        elif isinstance(item, str) and _NO_CITE_INNER.fullmatch(item.strip("[] ")) and len(raw) == 1:
            return Citation(answer=answer, cited=[], no_cite=True, warnings=warnings)
        else:
            _warn(warnings, f"dropped non-integer citation {str(item)[:40]!r}")
    if not tokens and raw:
        _warn(warnings, "no integer among the citations; treating the citation as unparseable")
        return Citation(answer=answer, cited=None, no_cite=False, warnings=warnings)
    return _finish(answer, tokens, n_shown, warnings)
