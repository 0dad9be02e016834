"""The OpenAI-compatible backend against an in-process mock server (httpx.MockTransport)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rmm.errors import LLMError
from rmm.llm import load_llm
from rmm.llm.openai import OpenAILLM
from rmm.prompts import ANSWER_SCHEMA


def completion(content: str, prompt_tokens: int = 7, completion_tokens: int = 3) -> dict:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


def make(handler, **options) -> OpenAILLM:
    sleeps: list[float] = []
    llm = OpenAILLM("http://test/v1", "m", transport=httpx.MockTransport(handler), sleep=sleeps.append, **options)
    llm.sleeps = sleeps  # type: ignore[attr-defined]
    return llm


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_success_sends_model_messages_and_counts_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMM_LLM_API_KEY", "secret")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=completion("hello [0]"))

    llm = make(handler)
    assert llm.generate([chat("hi")], max_tokens=16) == ["hello [0]"]
    body = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer secret"
    assert body["model"] == "m" and body["messages"] == chat("hi") and body["max_tokens"] == 16
    assert "response_format" not in body
    assert (llm.usage.calls, llm.usage.prompt_tokens, llm.usage.completion_tokens) == (1, 7, 3)


def test_batch_order_is_kept_under_concurrency() -> None:
    active, peak = 0, 0
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        index = int(json.loads(request.content)["messages"][0]["content"])
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.02 * (10 - index) / 10)  # later prompts finish first
        with lock:
            active -= 1
        return httpx.Response(200, json=completion(f"reply {index}"))

    llm = make(handler, concurrency=4)
    out = llm.generate([chat(str(i)) for i in range(10)])
    assert out == [f"reply {i}" for i in range(10)]
    assert 1 < peak <= 4
    assert llm.usage.calls == 10 and llm.usage.completion_tokens == 30


def test_retries_503_then_succeeds() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503, text="busy") if calls < 3 else httpx.Response(200, json=completion("ok"))

    llm = make(handler, backoff_s=0.5)
    assert llm.generate([chat("x")]) == ["ok"]
    assert calls == 3 and len(llm.sleeps) == 2
    assert 0.25 <= llm.sleeps[0] <= 0.75 and 0.5 <= llm.sleeps[1] <= 1.5  # exponential with jitter


def test_429_honours_retry_after() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return httpx.Response(429, headers={"Retry-After": "7"}, text="slow down")
        return httpx.Response(200, json=completion("ok"))

    llm = make(handler)
    assert llm.generate([chat("x")]) == ["ok"]
    assert llm.sleeps == [7.0]


def test_connection_errors_are_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=completion("ok"))

    assert make(handler).generate([chat("x")]) == ["ok"]
    assert calls == 2


def test_gives_up_after_max_retries_with_clear_error() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(502, text="bad gateway")

    llm = make(handler, max_retries=2)
    with pytest.raises(LLMError, match=r"failed after 3 tries.*HTTP 502"):
        llm.generate([chat("x")])
    assert calls == 3


def test_client_error_is_not_retried() -> None:
    llm = make(lambda r: httpx.Response(400, text="context length exceeded"))
    with pytest.raises(LLMError, match="400.*context length"):
        llm.generate([chat("x")])
    assert llm.sleeps == []


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, text="not json at all"),
        httpx.Response(200, json={"choices": []}),
        httpx.Response(200, json={"choices": [{"message": {"content": None}, "finish_reason": "length"}]}),
    ],
)
def test_malformed_response_raises_llm_error(response: httpx.Response) -> None:
    with pytest.raises(LLMError):
        make(lambda r: response).generate([chat("x")])


def test_json_schema_is_passed_through_as_response_format() -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=completion('{"answer": "a", "citations": [0]}'))

    make(handler).generate([chat("x")], json_schema=ANSWER_SCHEMA)
    format_ = bodies[0]["response_format"]
    assert format_["type"] == "json_schema" and format_["json_schema"]["schema"] == ANSWER_SCHEMA
    make(handler, structured="structured_outputs").generate([chat("x")], json_schema=ANSWER_SCHEMA)
    assert bodies[1]["structured_outputs"] == {"json": ANSWER_SCHEMA} and "response_format" not in bodies[1]
    make(handler, structured="guided_json").generate([chat("x")], json_schema=ANSWER_SCHEMA)
    assert bodies[2]["guided_json"] == ANSWER_SCHEMA
    make(handler, structured="prompt").generate([chat("x")], json_schema=ANSWER_SCHEMA)
    assert "JSON schema" in bodies[3]["messages"][-1]["content"]


def test_model_discovered_from_server_when_spec_has_none() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-model"}]})
        return httpx.Response(200, json=completion(json.loads(request.content)["model"]))

    llm = load_llm("openai:http://test/v1", transport=httpx.MockTransport(handler))
    assert llm.model == "served-model" and llm.generate([chat("x")]) == ["served-model"]


def test_bad_requests_are_rejected_before_sending() -> None:
    llm = make(lambda r: pytest.fail("must not send"))
    with pytest.raises(LLMError):
        llm.generate([[{"role": "robot", "content": "x"}]])
    with pytest.raises(LLMError):
        llm.generate([chat("x")], max_tokens=0)
    assert llm.generate([]) == []
