"""Any OpenAI-compatible chat endpoint through the official `openai` client — the production path
is a `vllm serve` server.

One `openai.AsyncOpenAI` client (one connection pool) lives on the backend's own event loop
(`rmm.llm.loop`): `generate` blocks on it, `agenerate` awaits it from any other loop, and one
asyncio semaphore keeps at most `concurrency` requests in flight across all callers. Retries and
timeouts are the client's: 408, 409, 429, 5xx and connection errors are retried up to
`max_retries` times with exponential backoff and jitter, honouring `Retry-After`; anything else,
or the last failure, becomes an `LLMError` that quotes the server.

Structured output (`json_schema=`) is sent as OpenAI's
`response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, which
vLLM's OpenAI server enforces with guided decoding. Other servers may need vLLM's own request
fields instead (sent through the client's `extra_body`) — pick them with `structured=`:

* `"response_format"` (default) — the OpenAI field above;
* `"structured_outputs"` — vLLM ≥ 0.12's extra body `{"structured_outputs": {"json": schema}}`;
* `"guided_json"` — older vLLM's extra body `{"guided_json": schema}`;
* `"prompt"` — no constrained decoding; the schema is only requested in the prompt.

Start a server (see `rmm.llm.vllm_server`):
`python -m vllm.entrypoints.openai.api_server --model PATH --host 127.0.0.1 --port 8000`
(or `vllm serve PATH`), then use the spec `openai:http://127.0.0.1:8000/v1@PATH`.
The API key comes from `api_key=`, else `$RMM_LLM_API_KEY`, else `$OPENAI_API_KEY`, else the
placeholder `EMPTY` (a local vLLM server started without `--api-key` accepts any key).
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx2
import openai
from openai.types.chat import ChatCompletion

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Shown, Usage
from rmm.llm.loop import BackgroundLoop
from rmm.llm.schema import schema_instruction, with_schema_instruction

__all__ = ["API_KEY_ENVS", "PLACEHOLDER_API_KEY", "STRUCTURED_MODES", "OpenAILLM", "schema_instruction"]

STRUCTURED_MODES = ("response_format", "structured_outputs", "guided_json", "prompt")
API_KEY_ENVS = ("RMM_LLM_API_KEY", "OPENAI_API_KEY")
PLACEHOLDER_API_KEY = "EMPTY"

T = TypeVar("T")


class OpenAILLM(LLM):
    """Chat completions over HTTP; see the module docstring for retries and structured output.

    `transport` replaces the HTTP transport (an `httpx2.AsyncBaseTransport`, e.g. a mock in tests).
    """

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
        structured: str = "response_format",
        extra_body: dict[str, Any] | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise LLMError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        if structured not in STRUCTURED_MODES:
            raise LLMError(f"structured must be one of {STRUCTURED_MODES}, got {structured!r}")
        if not _int(concurrency) or concurrency < 1 or not _int(max_retries) or max_retries < 0:
            raise LLMError(f"concurrency must be an int >= 1 and max_retries an int >= 0, got {concurrency!r}, "
                           f"{max_retries!r}")
        self.base_url = base_url.rstrip("/")
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.structured = structured
        self.extra_body = dict(extra_body or {})
        key = api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), PLACEHOLDER_API_KEY)
        limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._loop = BackgroundLoop("rmm-openai-llm")
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=key,
            max_retries=max_retries,
            timeout=httpx2.Timeout(timeout_s, connect=connect_timeout_s),
            http_client=openai.DefaultAsyncHttpx2Client(limits=limits, transport=transport),
        )
        self._semaphore = asyncio.Semaphore(concurrency)
        # Stops the loop thread and closes the connections even when close() is never called.
        self._closer = weakref.finalize(self, self._loop.stop, self._client.close)
        self.model = model or self._loop.run(self._first_served_model())
        super().__init__(f"openai:{self.base_url}@{self.model}")

    # -- requests (all run on the backend's loop) -----------------------------------------------
    async def _first_served_model(self) -> str:
        """A server that serves one model (vLLM) needs no model name in the spec."""
        page = await self._checked(f"GET {self.base_url}/models", self._client.models.list())
        try:
            return str(page.data[0].id)
        except (AttributeError, IndexError, TypeError) as error:
            raise LLMError(f"{self.base_url}/models lists no model; give one as openai:URL@MODEL") from error

    async def _checked(self, what: str, request: Awaitable[T]) -> T:
        """The request's result, or an LLMError saying what failed after how many tries."""
        try:
            return await request
        except openai.APIStatusError as error:
            tries = int(error.response.request.headers.get("x-stainless-retry-count", 0)) + 1
            last = f"HTTP {error.status_code}: {error.response.text[:300]}"
            raise LLMError(f"{what} failed after {_tries(tries)}; last error: {last}" if tries > 1
                           else f"{what} failed with {last}") from error
        except openai.APIConnectionError as error:  # connect, read timeout, reset, …: retried by the client
            cause = error.__cause__ or error
            raise LLMError(f"{what} failed after {_tries(self.max_retries + 1)}; last error: "
                           f"{type(cause).__name__}: {cause}") from error
        except openai.OpenAIError as error:
            raise LLMError(f"{what} failed: {error}") from error

    def _request(self, conversation: list[Message], json_schema: dict | None, max_tokens: int,
                 temperature: float) -> dict[str, Any]:
        """Keyword arguments of `chat.completions.create` for one conversation."""
        messages = [dict(m) for m in conversation]
        request: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature}
        extra_body: dict[str, Any] = {}
        if json_schema is not None:
            if self.structured == "response_format":
                request["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": str(json_schema.get("title", "response")), "schema": json_schema,
                                    "strict": True},
                }
            elif self.structured == "structured_outputs":
                extra_body["structured_outputs"] = {"json": json_schema}
            elif self.structured == "guided_json":
                extra_body["guided_json"] = json_schema
            else:
                messages = with_schema_instruction(messages, json_schema)
        request["messages"] = messages
        extra_body.update(self.extra_body)
        if extra_body:
            request["extra_body"] = extra_body
        return request

    async def _complete(self, request: dict[str, Any]) -> tuple[str, Usage]:
        async with self._semaphore:
            completion = await self._checked(f"POST {self.base_url}/chat/completions",
                                             self._client.chat.completions.create(**request))
        if not isinstance(completion, ChatCompletion) or not completion.choices:
            raise LLMError(f"malformed chat completion from {self.base_url}: {str(completion)[:300]}")
        choice = completion.choices[0]
        content = getattr(choice.message, "content", None)
        if not isinstance(content, str):
            raise LLMError(f"chat completion without text content (finish_reason={choice.finish_reason!r})")
        usage = completion.usage
        return content, Usage(calls=1, prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                              completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0))

    async def _batch(self, batch: list[list[Message]], json_schema: dict | None, max_tokens: int,
                     temperature: float) -> list[str]:
        """Every conversation at once (the semaphore bounds what is in flight), in the batch's order."""
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(self._complete(self._request(c, json_schema, max_tokens, temperature)))
                 for c in batch]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed (or the caller gave up): stop the rest
                task.cancel()
            raise
        total = Usage(calls=len(results), seconds=time.perf_counter() - started)
        for _, usage in results:
            total.prompt_tokens += usage.prompt_tokens
            total.completion_tokens += usage.completion_tokens
        self._record(total)
        return [text for text, _ in results]

    # -- interface ------------------------------------------------------------------------------
    def _generate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                  temperature: float = 0.0) -> list[str]:
        return self._loop.run(self._batch(batch, json_schema, max_tokens, temperature))

    async def agenerate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                        temperature: float = 0.0, shown: Shown | None = None) -> list[str]:
        """`generate` awaited from the caller's event loop; many calls may be in flight at once."""
        self._options(batch, json_schema, max_tokens, temperature, shown)
        if not batch:
            return []
        return await self._loop.wait(self._batch(batch, json_schema, max_tokens, temperature))

    def close(self) -> None:
        self._closer()


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tries(n: int) -> str:
    return f"{n} tries" if n != 1 else "1 try"
