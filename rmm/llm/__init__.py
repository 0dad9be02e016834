"""LLM backends behind one batched interface, chosen by a spec string (`load_llm`).

Backends import their heavy dependencies (transformers, vLLM) only when built.
"""

from __future__ import annotations

from typing import Any

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Usage

__all__ = ["LLM", "SPEC_FORMS", "LLMError", "Message", "Usage", "load_llm", "parse_spec"]

SPEC_FORMS = (
    (
        "openai:URL@MODEL (an OpenAI-compatible server, e.g. openai:http://127.0.0.1:8000/v1@my-model; "
        "@MODEL may be left out when the server serves one model)"
    ),
    "hf:PATH (a transformers chat model folder or a .gguf file)",
    "vllm:PATH (the in-process vLLM engine)",
    "simulated (the simulated citer; answers with citations only)",
)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """(backend, arguments) of a spec string; LLMError listing the valid forms otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise LLMError(_unknown(spec))
    spec = spec.strip()
    if spec == "simulated":
        return "simulated", {}
    kind, sep, rest = spec.partition(":")
    if not sep or not rest.strip():
        raise LLMError(_unknown(spec))
    if kind == "openai":
        url, at, model = rest.rpartition("@")
        if not at or ("/" not in url.partition("://")[2] and "/" in model):
            url, model = rest, ""  # no @MODEL; the @ belonged to credentials in the URL
        if not url.startswith(("http://", "https://")):
            raise LLMError(f"openai spec needs an http(s) URL: {spec!r}\n{_forms()}")
        return "openai", {"base_url": url, "model": model or None}
    if kind in ("hf", "vllm"):
        return kind, {"path": rest}
    raise LLMError(_unknown(spec))


def load_llm(spec: str, **options: Any) -> LLM:
    """Build the backend a spec names; `options` go to its constructor (e.g. concurrency=16)."""
    backend, args = parse_spec(spec)
    if backend == "openai":
        from rmm.llm.openai import OpenAILLM

        return OpenAILLM(args["base_url"], options.pop("model", None) or args["model"], **options)
    if backend == "hf":
        from rmm.llm.hf import HFLLM

        return HFLLM(args["path"], **options)
    if backend == "vllm":
        from rmm.llm.vllm_engine import VLLMEngine

        return VLLMEngine(args["path"], **options)
    from rmm.llm.simulated import SimulatedCiter, SimulatedLLM

    citer = options.pop("citer", None)
    oracle = options.pop("oracle", None)
    if citer is None:
        citer = SimulatedCiter(**options)
    elif options:
        raise LLMError(f"simulated: give either citer= or its options, not both: {sorted(options)}")
    return SimulatedLLM(citer, oracle)


def _forms() -> str:
    return "valid LLM specs:\n" + "\n".join(f"  {form}" for form in SPEC_FORMS)


def _unknown(spec: object) -> str:
    return f"unknown LLM spec {spec!r}\n{_forms()}"
