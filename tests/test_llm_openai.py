"""The OpenAI-compatible backend against an in-process mock server (httpx2.MockTransport, which
the `openai` client's HTTP layer accepts); the client's retry sleeps are recorded, not slept."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx2 as httpx
import openai
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


@pytest.fixture(autouse=True)
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The retry delays the client asked for (its sleep returns at once)."""
    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(openai._base_client.anyio, "sleep", sleep)
    return asked


@pytest.fixture
def make(sleeps: list[float]):
    made: list[OpenAILLM] = []

    def build(handler, **options) -> OpenAILLM:
        llm = OpenAILLM("http://test/v1", "m", transport=httpx.MockTransport(handler), **options)
        llm.sleeps = sleeps  # type: ignore[attr-defined]
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.close()


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_success_sends_model_messages_and_counts_usage(monkeypatch: pytest.MonkeyPatch, make) -> None:
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


def test_batch_order_is_kept_under_concurrency(make) -> None:
    active, peak = 0, 0
    lock = threading.Lock()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        index = int(json.loads(request.content)["messages"][0]["content"])
        with lock:
            active += 1
            peak = max(peak, active)
        await asyncio.sleep(0.02 * (10 - index) / 10)  # later prompts finish first
        with lock:
            active -= 1
        return httpx.Response(200, json=completion(f"reply {index}"))

    llm = make(handler, concurrency=4)
    out = llm.generate([chat(str(i)) for i in range(10)])
    assert out == [f"reply {i}" for i in range(10)]
    assert 1 < peak <= 4
    assert llm.usage.calls == 10 and llm.usage.completion_tokens == 30


def test_retries_503_then_succeeds(make) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503, text="busy") if calls < 3 else httpx.Response(200, json=completion("ok"))

    llm = make(handler)
    assert llm.generate([chat("x")]) == ["ok"]
    assert calls == 3 and len(llm.sleeps) == 2
    assert 0.25 <= llm.sleeps[0] <= 0.75 and 0.5 <= llm.sleeps[1] <= 1.5  # exponential with jitter


def test_429_honours_retry_after(make) -> None:
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


def test_connection_errors_are_retried(make) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=completion("ok"))

    assert make(handler).generate([chat("x")]) == ["ok"]
    assert calls == 2


def test_gives_up_after_max_retries_with_clear_error(make) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(502, text="bad gateway")

    llm = make(handler, max_retries=2)
    with pytest.raises(LLMError, match=r"failed after 3 tries.*HTTP 502"):
        llm.generate([chat("x")])
    assert calls == 3


def test_client_error_is_not_retried(make) -> None:
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
def test_malformed_response_raises_llm_error(response: httpx.Response, make) -> None:
    with pytest.raises(LLMError):
        make(lambda r: response).generate([chat("x")])


def test_json_schema_is_passed_through_as_response_format(make) -> None:
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

    with load_llm("openai:http://test/v1", transport=httpx.MockTransport(handler)) as llm:
        assert llm.model == "served-model" and llm.generate([chat("x")]) == ["served-model"]
    with pytest.raises(LLMError, match="lists no model"):
        load_llm("openai:http://test/v1", transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"data": []})))


def test_bad_requests_are_rejected_before_sending(make) -> None:
    llm = make(lambda r: pytest.fail("must not send"))
    with pytest.raises(LLMError):
        llm.generate([[{"role": "robot", "content": "x"}]])
    with pytest.raises(LLMError):
        llm.generate([chat("x")], max_tokens=0)
    assert llm.generate([]) == []


def test_placeholder_key_when_none_is_configured(monkeypatch: pytest.MonkeyPatch, make) -> None:
    for name in ("RMM_LLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=completion("ok"))

    make(handler).generate([chat("x")])
    monkeypatch.setenv("OPENAI_API_KEY", "from-openai-env")
    make(handler).generate([chat("x")])
    assert [r.headers["authorization"] for r in seen] == ["Bearer EMPTY", "Bearer from-openai-env"]


def test_dead_server_is_an_llm_error_after_the_retries(make) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    llm = make(handler, max_retries=3)
    with pytest.raises(LLMError, match=r"POST http://test/v1/chat/completions failed after 4 tries.*refused"):
        llm.generate([chat("x")])
    assert calls == 4 and len(llm.sleeps) == 3
    assert llm.usage.calls == 0  # nothing answered, nothing counted


def test_agenerate_keeps_many_batches_in_flight_from_the_callers_loop(make) -> None:
    active, peak = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1  # the handler runs on the backend's one loop: no lock needed
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return httpx.Response(200, json=completion(json.loads(request.content)["messages"][0]["content"]))

    llm = make(handler, concurrency=5)

    async def trainer() -> list[list[str]]:
        return await asyncio.gather(*(llm.agenerate([chat(f"{b}.{i}") for i in range(3)]) for b in range(4)))

    assert asyncio.run(trainer()) == [[f"{b}.{i}" for i in range(3)] for b in range(4)]
    assert peak == 5  # twelve requests, at most `concurrency` at once across all batches
    assert llm.usage.calls == 12 and llm.usage.completion_tokens == 36
    assert asyncio.run(llm.agenerate([])) == []
    with pytest.raises(LLMError):
        asyncio.run(llm.agenerate([chat("x")], temperature=-1))


def test_one_failure_fails_the_batch_and_cancels_the_rest(make) -> None:
    started: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][0]["content"]
        started.append(text)
        if text == "bad":
            for _ in range(500):  # fail only once all three requests are in flight: the cancellation is what is tested
                if len(started) == 3:
                    break
                await asyncio.sleep(0.01)
            return httpx.Response(400, text="prompt too long")
        if text == "slow":
            await asyncio.sleep(30)  # only cancellation ends this in time
        return httpx.Response(200, json=completion(text))

    llm = make(handler, concurrency=4)
    began = time.perf_counter()
    with pytest.raises(LLMError, match="failed with HTTP 400: prompt too long"):
        llm.generate([chat("slow"), chat("bad"), chat("slow")])
    assert time.perf_counter() - began < 10
    assert sorted(started) == ["bad", "slow", "slow"]
    assert llm.generate([chat("again")]) == ["again"]  # the backend is still usable


def test_extra_body_reaches_the_server_and_close_stops_the_backend(make) -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=completion("ok"))

    llm = make(handler, structured="structured_outputs", extra_body={"top_k": 5})
    llm.generate([chat("x")], json_schema=ANSWER_SCHEMA)
    assert bodies[0]["top_k"] == 5 and bodies[0]["structured_outputs"] == {"json": ANSWER_SCHEMA}
    threads = {t.name for t in threading.enumerate()}
    assert "rmm-openai-llm" in threads
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(LLMError, match="closed"):
        llm.generate([chat("x")])
