"""Spec parsing, the simulated LLM, the missing-vLLM path, and the transformers backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rmm.errors import LLMError, ModelNotFoundError
from rmm.llm import LLM, load_llm, parse_spec
from rmm.llm.simulated import SimulatedCiter, SimulatedLLM, gold_evidence_oracle
from rmm.policy.citations import parse_citations, parse_json_citations
from rmm.prompts import (
    ANSWER_SCHEMA,
    answer_messages,
    extraction_messages,
    judge_messages,
)
from rmm.types import Memory, Session, Turn


def memories(*texts: str) -> list[Memory]:
    return [Memory(id=str(i), user_id="u", kind="topic", text=t) for i, t in enumerate(texts)]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("openai:http://127.0.0.1:8000/v1@MODEL", ("openai", {"base_url": "http://127.0.0.1:8000/v1", "model": "MODEL"})),
        ("openai:https://h/v1@org/model-7b", ("openai", {"base_url": "https://h/v1", "model": "org/model-7b"})),
        ("openai:http://h:8000/v1", ("openai", {"base_url": "http://h:8000/v1", "model": None})),
        ("hf:/models/smol.gguf", ("hf", {"path": "/models/smol.gguf"})),
        ("vllm:/models/qwen", ("vllm", {"path": "/models/qwen"})),
        ("simulated", ("simulated", {})),
    ],
)
def test_parse_spec(spec: str, expected: tuple) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "gpt4", "ollama:x", "hf:", "openai:not-a-url@m"])
def test_unknown_spec_lists_the_forms(spec: str) -> None:
    with pytest.raises(LLMError, match="(?s)openai:URL@MODEL.*hf:PATH.*vllm:PATH.*simulated"):
        load_llm(spec)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_missing_gives_install_hint() -> None:
    with pytest.raises(LLMError, match=r"vllm is not installed: pip install 'rmm\[gpu\]'"):
        load_llm("vllm:/models/x")


def test_simulated_cites_what_the_oracle_marks_gold() -> None:
    seen: list[list[str]] = []

    def oracle(shown: list[Memory]) -> list[bool]:
        seen.append([m.id for m in shown])
        return ["hiking" in m.text for m in shown]

    llm = load_llm("simulated", precision=1.0, recall=1.0, oracle=oracle)
    first, second = memories("Ana likes hiking", "Ana has a cat", "hiking\nin the Alps"), memories("Ana has a cat")
    batch = [answer_messages("What do I like?", first), answer_messages("Anything?", second)]
    out = llm.generate(batch, shown=[first, second])
    assert seen == [["0", "1", "2"], ["0"]]  # the Memory records themselves, in shown order
    assert all(o.startswith("[simulated answer]") for o in out)
    assert parse_citations(out[0], 3).cited == [0, 2]
    assert parse_citations(out[1], 1).no_cite
    structured = llm.generate(batch[:1], json_schema=ANSWER_SCHEMA, shown=[first])
    assert json.loads(structured[0])["citations"] == [0, 2]
    assert parse_json_citations(structured[0], 3).cited == [0, 2]
    assert llm.usage.calls == 3


def test_gold_evidence_oracle_marks_memories_that_refer_to_gold_turns() -> None:
    shown = [Memory("a", "u", "topic", "x", refs=["c:D1:1", "c:D1:2"]), Memory("b", "u", "topic", "y", refs=["c:D2:1"]),
             Memory("c", "u", "topic", "z")]
    llm = SimulatedLLM(SimulatedCiter(precision=1.0, recall=1.0), oracle=gold_evidence_oracle({"c:D1:2"}))
    (reply,) = llm.generate([answer_messages("q", shown)], shown=[shown])
    assert parse_citations(reply, 3).cited == [0]
    assert list(gold_evidence_oracle([])(shown)) == [False, False, False]


def test_simulated_refuses_other_prompts_and_needs_an_oracle() -> None:
    session = Session("s", "u", [Turn("t0", "s", "Ana", "I hike")])
    llm = SimulatedLLM(SimulatedCiter(), oracle=lambda shown: [False] * len(shown))
    for messages in (extraction_messages(session, "Ana"), judge_messages("q", "a", "p")):
        with pytest.raises(LLMError, match="only answers with citations"):
            llm.generate([messages])
    shown = memories("m")
    with pytest.raises(LLMError, match="oracle"):
        SimulatedLLM().generate([answer_messages("q", shown)], shown=[shown])
    with pytest.raises(LLMError, match="oracle returned 2 hits for 1"):
        SimulatedLLM(oracle=lambda shown: [True, True]).generate([answer_messages("q", shown)], shown=[shown])


def test_shown_must_match_the_batch_and_real_backends_never_see_it() -> None:
    shown = memories("m")
    llm = SimulatedLLM(oracle=lambda s: [False] * len(s))
    with pytest.raises(LLMError, match="one list of memories per conversation"):
        llm.generate([answer_messages("q", shown)] * 2, shown=[shown])
    with pytest.raises(LLMError, match="Memory records"):
        llm.generate([answer_messages("q", shown)], shown=[["just text"]])  # type: ignore[list-item]

    class Echo(LLM):  # a backend with the plain `_generate` keywords, as every real one has
        def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
            return [c[-1]["content"][:1] for c in batch]

    assert Echo("echo").generate([[{"role": "user", "content": "hi"}]], shown=[shown]) == ["h"]


def test_agenerate_runs_any_backend_from_an_event_loop() -> None:
    import asyncio

    shown = memories("Ana likes hiking")
    llm = SimulatedLLM(SimulatedCiter(precision=1.0, recall=1.0), oracle=lambda s: [True] * len(s))
    (reply,) = asyncio.run(llm.agenerate([answer_messages("q", shown)], shown=[shown]))
    assert parse_citations(reply, 1).cited == [0]


# -- transformers backend on a tiny random model ------------------------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model: Path):
    return load_llm(f"hf:{tiny_chat_model}", device="cpu", batch_size=2, threads=1)


def test_hf_generates_one_text_per_conversation_in_order(tiny_llm) -> None:
    llm = tiny_llm
    llm.usage = type(llm.usage)()
    batch = [[{"role": "user", "content": text}] for text in ("hi", "a much longer question about hiking", "x")]
    together = llm.generate(batch, max_tokens=5)
    alone = [llm.generate([conversation], max_tokens=5)[0] for conversation in batch]
    assert len(together) == 3 and all(isinstance(t, str) for t in together)
    assert together == alone  # left padding: batching does not change greedy outputs
    assert llm.usage.calls == 6
    assert llm.usage.completion_tokens == 6 * 5  # no eos token: every row runs to max_tokens
    assert llm.usage.prompt_tokens > 0 and llm.usage.seconds > 0


def test_hf_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_llm(f"hf:{tmp_path / 'nothing'}")


def test_hf_json_schema_is_requested_in_the_prompt(tiny_llm) -> None:
    llm = tiny_llm
    (prompt,) = llm._prompts([[{"role": "user", "content": "q"}]], ANSWER_SCHEMA)
    assert '"citations"' in prompt and prompt.rstrip().endswith("[assistant]")
    assert len(llm.generate([[{"role": "user", "content": "q"}]], json_schema=ANSWER_SCHEMA, max_tokens=2)) == 1


def test_hf_gguf_folder_resolution_errors(tmp_path: Path) -> None:
    from rmm.llm.hf import convert_gguf, resolve_model_folder

    with pytest.raises(ModelNotFoundError):
        convert_gguf(tmp_path / "missing.gguf")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(LLMError, match="several GGUF"):
        resolve_model_folder(tmp_path)
    with pytest.raises(LLMError, match="could not read GGUF"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out")  # not a GGUF file


def test_vllm_engine_against_a_stand_in_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine path with a fake `vllm` (the real one needs a GPU machine): chat, order, JSON."""
    import sys
    import types
    from dataclasses import dataclass, field

    @dataclass
    class StructuredOutputsParams:
        json: dict | None = None

    @dataclass
    class SamplingParams:
        max_tokens: int = 16
        temperature: float = 1.0
        structured_outputs: StructuredOutputsParams | None = None

    @dataclass
    class Completion:
        text: str
        token_ids: list[int] = field(default_factory=lambda: [1, 2])

    @dataclass
    class Output:
        prompt_token_ids: list[int]
        outputs: list[Completion]

    calls: list[tuple] = []

    class FakeEngine:
        def __init__(self, model: str, **options) -> None:
            calls.append(("init", model, options))

        def chat(self, messages, sampling_params, use_tqdm=True):
            calls.append(("chat", sampling_params))
            return [Output([0] * 5, [Completion(f"reply to {m[-1]['content']}")]) for m in messages]

    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeEngine  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.StructuredOutputsParams = StructuredOutputsParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)

    llm = load_llm("vllm:/models/m", max_model_len=2048)
    out = llm.generate([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                       json_schema=ANSWER_SCHEMA, max_tokens=32)
    assert out == ["reply to a", "reply to b"]
    assert calls[0] == ("init", "/models/m", {"max_model_len": 2048})
    params = calls[1][1]
    assert params.max_tokens == 32 and params.temperature == 0.0
    assert params.structured_outputs == StructuredOutputsParams(json=ANSWER_SCHEMA)
    assert (llm.usage.calls, llm.usage.prompt_tokens, llm.usage.completion_tokens) == (2, 10, 4)


def test_hf_folds_system_into_user_for_templates_without_system(tiny_llm) -> None:
    original = tiny_llm.tokenizer.chat_template
    tiny_llm.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    try:
        (prompt,) = tiny_llm._prompts([[{"role": "system", "content": "rules"}, {"role": "user", "content": "q"}]], None)
    finally:
        tiny_llm.tokenizer.chat_template = original
    assert prompt == "<user>rules\n\nq<assistant>"

