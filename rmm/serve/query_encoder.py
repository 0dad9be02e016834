"""The server's query path on CPU in int8: the cost every retrieve request pays.

Under load the server's time goes mostly to encoding queries (a MiniLM forward pass per
micro-batch). Dynamic int8 quantization of the transformer's linear layers (weights int8 per
output channel, activations quantized on the fly; fbgemm / oneDNN VNNI kernels) roughly halves
that on a CPU, for a query embedding within ~0.98 cosine of the float one. Only queries take
this path: passages — what the bank stores — are still encoded in float32, so a bank is served
the same with or without it and nothing stored changes. `scripts/recall_query_encoder.py`
measures what it costs in recall on LoCoMo (`configs/serve.yaml` quotes the figure).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch
from torch import nn

from rmm.errors import ConfigError
from rmm.memory.bank import EncoderLike

__all__ = ["QUERY_PRECISIONS", "Int8QueryEncoder", "query_encoder"]

log = logging.getLogger(__name__)

QUERY_PRECISIONS = ("auto", "float32", "int8")


def quantize_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose linear layers run in int8 (weights per output channel)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, nn.Linear):  # the encoder's oneDNN subclass too: quantize the plain layer
            module.__class__ = nn.Linear
    with warnings.catch_warnings():  # torch.ao's eager quantization warns that torchao succeeds it
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(copied, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


class Int8QueryEncoder:
    """An `rmm.encoders.Encoder` whose queries go through an int8 copy of its model; passages,
    name, dimension and fingerprint are the float encoder's (the bank sees the same encoder)."""

    def __init__(self, encoder: Any) -> None:
        if getattr(encoder, "device", torch.device("cpu")).type != "cpu":
            raise ConfigError("query_precision: int8 runs on the CPU; the encoder is on "
                              f"{encoder.device} (use float32 there)")
        self.inner = encoder
        self.name, self.dim, self.fingerprint = encoder.name, int(encoder.dim), encoder.fingerprint
        self._queries = copy.copy(encoder)  # shares the tokenizer, config and dense head
        self._queries.model = quantize_linears(encoder.model)

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return self._queries.encode_queries(texts)

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)


def query_encoder(encoder: EncoderLike, precision: str) -> EncoderLike:
    """The encoder the server should use for `precision` (`auto`: int8 for a transformer encoder
    on the CPU when this torch has int8 kernels, else float32)."""
    if precision not in QUERY_PRECISIONS:
        raise ConfigError(f"query_precision must be one of {list(QUERY_PRECISIONS)}, got {precision!r}")
    transformer = isinstance(getattr(encoder, "model", None), nn.Module)
    on_cpu = getattr(encoder, "device", torch.device("cpu")).type == "cpu"
    kernels = bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))
    if precision == "auto":
        precision = "int8" if transformer and on_cpu and kernels else "float32"
    if precision == "float32":
        return encoder
    if not transformer:
        raise ConfigError(f"query_precision: int8 needs a transformer encoder; {encoder.name!r} is not one")
    if not kernels:
        raise ConfigError("query_precision: int8 needs torch's x86/fbgemm int8 kernels, which this build lacks")
    log.info("query encoder %s: linear layers in int8 (passages stay float32)", encoder.name)
    return Int8QueryEncoder(encoder)
