"""The in-process vLLM engine, for offline batches on a GPU machine (`pip install 'rmm[gpu]'`).

vLLM is imported only when this backend is built, so the package works without it. Chats go
through `LLM.chat` (the model's own chat template); structured output uses vLLM's guided
decoding: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` on vLLM ≥ 0.12
(0.32 is the pinned version), `SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))`
on older releases — whichever this install has.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Usage

__all__ = ["VLLMEngine", "import_vllm"]

log = logging.getLogger(__name__)

MISSING = "vllm is not installed: pip install 'rmm[gpu]'"


def import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as error:
        raise LLMError(MISSING) from error


def _structured_kwargs(json_schema: dict) -> dict[str, Any]:
    """The SamplingParams keyword that asks this vLLM for JSON matching the schema."""
    try:
        params = importlib.import_module("vllm.sampling_params")
    except ImportError as error:
        raise LLMError(MISSING) from error
    if hasattr(params, "StructuredOutputsParams"):
        return {"structured_outputs": params.StructuredOutputsParams(json=json_schema)}
    if hasattr(params, "GuidedDecodingParams"):
        return {"guided_decoding": params.GuidedDecodingParams(json=json_schema)}
    raise LLMError("this vLLM has neither StructuredOutputsParams nor GuidedDecodingParams")


class VLLMEngine(LLM):
    """`vllm.LLM(model=path)`; extra keyword options go to its constructor unchanged."""

    def __init__(self, model_path: str, **engine_options: Any) -> None:
        vllm = import_vllm()
        super().__init__(f"vllm:{model_path}")
        self.model_path = model_path
        try:
            self._engine = vllm.LLM(model=str(model_path), **engine_options)
        except Exception as error:  # vLLM raises many kinds; surface one typed error
            raise LLMError(f"vLLM could not load {model_path}: {error}") from error
        self._sampling_params = vllm.SamplingParams

    def _generate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                  temperature: float = 0.0) -> list[str]:
        extra = _structured_kwargs(json_schema) if json_schema is not None else {}
        params = self._sampling_params(max_tokens=max_tokens, temperature=temperature, **extra)
        started = time.perf_counter()
        try:
            outputs = self._engine.chat([list(c) for c in batch], sampling_params=params, use_tqdm=False)
        except Exception as error:
            raise LLMError(f"vLLM generation failed: {error}") from error
        usage = Usage(calls=len(batch), seconds=time.perf_counter() - started)
        texts: list[str] = []
        for output in outputs:  # vLLM returns outputs in prompt order
            completion = output.outputs[0]
            texts.append(completion.text)
            usage.prompt_tokens += len(output.prompt_token_ids or [])
            usage.completion_tokens += len(completion.token_ids or [])
        self._record(usage)
        return texts
