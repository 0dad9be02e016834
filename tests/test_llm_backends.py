"""Spec parsing, the simulated LLM, the missing-vLLM path, and the transformers backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rmm.citations import parse_citations, parse_json_citations
from rmm.errors import LLMError, ModelNotFoundError
from rmm.llm import load_llm, parse_spec
from rmm.llm.simulated import SimulatedCiter
from rmm.llm.simulated_backend import SimulatedLLM
from rmm.prompts import ANSWER_SCHEMA, answer_messages, extraction_messages, judge_messages
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
    shown: list[list[str]] = []

    def oracle(texts: list[str]) -> list[bool]:
        shown.append(texts)
        return ["hiking" in t for t in texts]

    llm = load_llm("simulated", precision=1.0, recall=1.0, oracle=oracle)
    batch = [
        answer_messages("What do I like?", memories("Ana likes hiking", "Ana has a cat", "hiking\nin the Alps")),
        answer_messages("Anything?", memories("Ana has a cat")),
    ]
    out = llm.generate(batch)
    assert shown == [["Ana likes hiking", "Ana has a cat", "hiking\nin the Alps"], ["Ana has a cat"]]
    assert all(o.startswith("[simulated answer]") for o in out)
    assert parse_citations(out[0], 3).cited == [0, 2]
    assert parse_citations(out[1], 1).no_cite
    structured = llm.generate(batch[:1], json_schema=ANSWER_SCHEMA)
    assert json.loads(structured[0])["citations"] == [0, 2]
    assert parse_json_citations(structured[0], 3).cited == [0, 2]
    assert llm.usage.calls == 3


def test_simulated_refuses_other_prompts_and_needs_an_oracle() -> None:
    session = Session("s", "u", [Turn("t0", "s", "Ana", "I hike")])
    llm = SimulatedLLM(SimulatedCiter(), oracle=lambda texts: [False] * len(texts))
    for messages in (extraction_messages(session, "Ana"), judge_messages("q", "a", "p")):
        with pytest.raises(LLMError, match="only answers with citations"):
            llm.generate([messages])
    with pytest.raises(LLMError, match="oracle"):
        SimulatedLLM().generate([answer_messages("q", memories("m"))])


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


def test_hf_generates_one_text_per_conversation_in_order(tiny_chat_model: Path) -> None:
    llm = load_llm(f"hf:{tiny_chat_model}", device="cpu", batch_size=2)
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
