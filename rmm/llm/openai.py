"""Any OpenAI-compatible chat endpoint — the production path is a `vllm serve` server.

One `httpx.Client` (connection reuse) shared by a bounded thread pool: the batch's requests run
`concurrency` at a time and come back in the batch's order. Transient failures (429, 5xx,
connection errors, timeouts) are retried with exponential backoff and jitter, honouring
`Retry-After`; anything else fails at once with an `LLMError` that quotes the server.

Structured output (`json_schema=`) is sent as OpenAI's
`response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, which
vLLM's OpenAI server enforces with guided decoding. Other servers may need vLLM's own request
fields instead — pick them with `structured=`:

* `"response_format"` (default) — the OpenAI field above;
* `"structured_outputs"` — vLLM ≥ 0.12's extra body `{"structured_outputs": {"json": schema}}`;
* `"guided_json"` — older vLLM's extra body `{"guided_json": schema}`;
* `"prompt"` — no constrained decoding; the schema is only requested in the prompt.

Start a server (see `rmm.llm.vllm_server`):
`python -m vllm.entrypoints.openai.api_server --model PATH --host 127.0.0.1 --port 8000`
(or `vllm serve PATH`), then use the spec `openai:http://127.0.0.1:8000/v1@PATH`.
The API key comes from `api_key=`, else `$RMM_LLM_API_KEY`, else `$OPENAI_API_KEY` (none is sent
when all are empty — a local vLLM server needs none).
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Usage

__all__ = ["RETRY_STATUSES", "OpenAILLM", "schema_instruction"]

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
STRUCTURED_MODES = ("response_format", "structured_outputs", "guided_json", "prompt")
API_KEY_ENVS = ("RMM_LLM_API_KEY", "OPENAI_API_KEY")


def schema_instruction(json_schema: dict) -> str:
    """The request for JSON that backends without constrained decoding add to the prompt."""
    return (
        "\n\nRespond with only a JSON object (no code fence, no other text) that matches this "
        f"JSON schema:\n{json.dumps(json_schema)}"
    )


def with_schema_instruction(conversation: list[Message], json_schema: dict) -> list[Message]:
    """The conversation with the JSON request appended to its last user message."""
    messages = [dict(m) for m in conversation]
    for message in reversed(messages):
        if message["role"] == "user":
            message["content"] += schema_instruction(json_schema)
            return messages
    return messages + [{"role": "user", "content": schema_instruction(json_schema).strip()}]


class OpenAILLM(LLM):
    """Chat completions over HTTP; see the module docstring for retries and structured output."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        structured: str = "response_format",
        extra_body: dict[str, Any] | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise LLMError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        if structured not in STRUCTURED_MODES:
            raise LLMError(f"structured must be one of {STRUCTURED_MODES}, got {structured!r}")
        if concurrency < 1 or max_retries < 0:
            raise LLMError("concurrency must be >= 1 and max_retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.structured = structured
        self.extra_body = dict(extra_body or {})
        self._sleep = sleep
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        key = api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            transport=transport,
        )
        self.model = model or self._first_served_model()
        super().__init__(f"openai:{self.base_url}@{self.model}")

    # -- requests ---------------------------------------------------------------------------
    def _first_served_model(self) -> str:
        """A server that serves one model (vLLM) needs no model name in the spec."""
        body = self._request("GET", "/models", None)
        try:
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as error:
            raise LLMError(
                f"{self.base_url}/models lists no model; give one as openai:URL@MODEL"
            ) from error

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None and (header := response.headers.get("retry-after")):
            seconds = _retry_after_seconds(header)
            if seconds is not None:
                return min(seconds, self.max_backoff_s * 4)
        with self._rng_lock:
            jitter = self._rng.uniform(0.5, 1.5)
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * jitter

    def _request(self, method: str, path: str, payload: dict | None) -> Any:
        last = ""
        for attempt in range(self.max_retries + 1):
            response: httpx.Response | None = None
            try:
                response = self._client.request(method, path, json=payload)
            except httpx.TransportError as error:  # connect, read timeout, reset, …
                last = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError as error:
                        raise LLMError(
                            f"{method} {self.base_url}{path}: response is not JSON: {response.text[:300]!r}"
                        ) from error
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in RETRY_STATUSES:
                    raise LLMError(f"{method} {self.base_url}{path} failed with {last}")
            if attempt == self.max_retries:
                break
            delay = self._delay(attempt, response)
            log.warning("%s %s: %s; retry %d/%d in %.1fs", method, path, last, attempt + 1,
                        self.max_retries, delay)
            self._sleep(delay)
        raise LLMError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} tries; last error: {last}"
        )

    def _payload(self, conversation: list[Message], json_schema: dict | None, max_tokens: int,
                 temperature: float) -> dict[str, Any]:
        messages = [dict(m) for m in conversation]
        payload: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature}
        if json_schema is not None:
            if self.structured == "response_format":
                payload["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": str(json_schema.get("title", "response")), "schema": json_schema,
                                    "strict": True},
                }
            elif self.structured == "structured_outputs":
                payload["structured_outputs"] = {"json": json_schema}
            elif self.structured == "guided_json":
                payload["guided_json"] = json_schema
            else:
                messages = with_schema_instruction(messages, json_schema)
        payload["messages"] = messages
        payload.update(self.extra_body)
        return payload

    def _complete(self, payload: dict[str, Any]) -> tuple[str, Usage]:
        started = time.perf_counter()
        body = self._request("POST", "/chat/completions", payload)
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as error:
            raise LLMError(f"malformed chat completion from {self.base_url}: {str(body)[:300]}") from error
        if not isinstance(content, str):
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            raise LLMError(f"chat completion without text content (finish_reason={reason!r})")
        usage = body.get("usage") if isinstance(body, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        return content, Usage(
            calls=1,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            seconds=time.perf_counter() - started,
        )

    # -- interface --------------------------------------------------------------------------
    def _generate(
        self,
        batch: list[list[Message]],
        *,
        json_schema: dict | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
    ) -> list[str]:
        started = time.perf_counter()
        payloads = [self._payload(c, json_schema, max_tokens, temperature) for c in batch]
        workers = min(self.concurrency, len(payloads))
        if workers == 1:
            results = [self._complete(p) for p in payloads]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rmm-llm") as pool:
                results = list(pool.map(self._complete, payloads))  # map keeps the input order
        total = Usage(calls=len(results), seconds=time.perf_counter() - started)
        for _, usage in results:
            total.prompt_tokens += usage.prompt_tokens
            total.completion_tokens += usage.completion_tokens
        self._record(total)
        return [text for text, _ in results]

    def close(self) -> None:
        self._client.close()


def _retry_after_seconds(header: str) -> float | None:
    """`Retry-After` as seconds: either a number or an HTTP date."""
    header = header.strip()
    try:
        return max(0.0, float(header))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())
