"""The server's query path on CPU in int8: the cost every retrieve request pays.

Under load the server's time goes mostly to encoding queries (a MiniLM forward pass per
micro-batch). Running the transformer's linear layers in int8 (weights per output channel,
activations quantized on the fly, integer matmul) roughly halves that on a CPU. Only queries
take this path: passages — what the bank stores — are still encoded in float32, so a bank is
served the same with or without it and nothing stored changes. `scripts/recall_query_encoder.py`
measures what it costs in recall on LoCoMo (`configs/serve.yaml` quotes the figure).

Activations are quantized *per token* (one scale per row), not per tensor as torch's dynamic
quantization does: with one scale for the whole input, a query's embedding depended on the other
queries of its micro-batch and on their padding (cosine 0.96 between a query encoded alone and in
a batch of 32 LoCoMo questions), so a request's ranking changed with whoever else was asking.
With a scale per row the integer matmul (`torch._int_mm`, exact) sees the same numbers for a
query whatever its batch; what is left is float rounding of the attention over padded lengths
(as float32 has), which can flip an activation's rounding to int8 now and then
(`scripts/recall_query_batching.py` measures both against float32 and alone vs batched).

`int8-onnx` runs the same scheme as an ONNX graph in ONNX Runtime (`rmm.encoders.onnx_backend`,
the optional `rmm[onnx]` extra): at one thread ~2.1x less CPU than torch's int8 for a query
encoded alone, 1.1-1.2x in micro-batches of 32 (`scripts/bench_onnx_encoder.py`), the same recall
and batch invariance on LoCoMo (`scripts/recall_onnx_query_batching.py`); its vectors differ
from torch int8's by float rounding in the non-quantized ops (cosine > 0.997). Opt-in: `auto`
stays torch.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rmm.errors import ConfigError
from rmm.encoders.protocol import EncoderLike
from rmm.encoders.query.int8_linear import RowInt8Linear, int8_kernels, quantize_linears
from rmm.encoders.query.packed_bert import PackedInt8Bert, packable, unpack

__all__ = ["QUERY_PRECISIONS", "Int8QueryEncoder", "RowInt8Linear", "quantize_linears", "query_encoder"]

log = logging.getLogger(__name__)

QUERY_PRECISIONS = ("auto", "float32", "int8", "int8-onnx")
PAD_MULTIPLE = 8  # queries are padded to a multiple of this many tokens (see Int8QueryEncoder.encode_queries)


class Int8QueryEncoder:
    """An `rmm.encoders.Encoder` whose queries go through an int8 copy of its model; passages,
    name, dimension and fingerprint are the float encoder's (the bank sees the same encoder).

    `engine` runs the int8 model: `torch` (`RowInt8Linear` layers) or `onnx` (the same scheme as
    a cached ONNX graph in ONNX Runtime; raises `OnnxBackendError` when that cannot run). With
    `torch`, a plain BERT encoder (MiniLM, Contriever) runs packed — a micro-batch's tokens without
    padding, one pass (`rmm.encoders.query.packed_bert`); `packed=False` or any other model pads each query
    to a multiple of `PAD_MULTIPLE` tokens instead.
    """

    def __init__(self, encoder: Any, engine: str = "torch", *, packed: bool = True) -> None:
        if getattr(encoder, "device", torch.device("cpu")).type != "cpu":
            raise ConfigError("query_precision: int8 runs on the CPU; the encoder is on "
                              f"{encoder.device} (use float32 there)")
        if engine not in ("torch", "onnx"):
            raise ConfigError(f"int8 engine must be 'torch' or 'onnx', got {engine!r}")
        self.inner = encoder
        self.name, self.dim, self.fingerprint = encoder.name, int(encoder.dim), encoder.fingerprint
        self.engine = engine
        self._queries = copy.copy(encoder)  # shares the tokenizer, config and dense head
        if engine == "onnx":
            from rmm.encoders.onnx_backend import open_graph

            self._forward: Callable[[dict[str, torch.Tensor]], torch.Tensor] = open_graph(encoder, "int8-rows")
        self._packed: PackedInt8Bert | None = None
        if engine == "torch" and packed and packable(encoder.model):
            self._packed = PackedInt8Bert(encoder.model)
        elif engine == "torch":
            self._queries.model = quantize_linears(encoder.model)
            self._forward = self._queries.embed

    @torch.inference_mode()
    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        """Packed (see the class), or each query padded to its own length rounded up to `PAD_MULTIPLE`, never to its batch's
        longest: queries of one padded length are encoded together, so a query sees the same
        numbers alone or in any micro-batch (the int8 matmul is exact; the float ops run per row
        and per sequence on the same shapes), and padding costs at most `PAD_MULTIPLE - 1` tokens."""
        encoder = self._queries
        if not texts:
            return encoder.encode_queries(texts)
        sequences = encoder.tokenize(texts, encoder.config.query_prefix)
        if self._packed is not None:
            hidden, mask = unpack(self._packed(sequences), [len(s) for s in sequences])
            return encoder.sentence_embeddings(hidden, mask).float()
        groups: dict[int, list[int]] = {}
        for i, sequence in enumerate(sequences):
            groups.setdefault(_padded_length(len(sequence), encoder.max_length), []).append(i)
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        for length, positions in groups.items():
            inputs = _pad_to(encoder.collate([sequences[i] for i in positions]), length, encoder.padding_side,
                             encoder.pad_token_id)
            out[torch.tensor(positions, dtype=torch.long)] = self._forward(inputs).float().cpu()
        return out

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)


def _padded_length(length: int, max_length: int) -> int:
    return min(max_length, -(-length // PAD_MULTIPLE) * PAD_MULTIPLE)


def _pad_to(inputs: dict[str, torch.Tensor], length: int, side: str, pad_id: int) -> dict[str, torch.Tensor]:
    """`collate`'s inputs (padded to the group's longest) padded on to `length` tokens."""
    extra = length - inputs["input_ids"].shape[1]
    if extra <= 0:
        return inputs
    widths = (extra, 0) if side == "left" else (0, extra)
    fill = {"input_ids": pad_id, "attention_mask": 0}
    padded = {key: torch.nn.functional.pad(value, widths, value=fill.get(key, 0)) for key, value in inputs.items()}
    if "position_ids" in inputs:  # left padding: positions count real tokens only (as `collate` does)
        padded["position_ids"] = (padded["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    return padded


def query_encoder(encoder: EncoderLike, precision: str) -> EncoderLike:
    """The encoder the server should use for `precision` (`auto`: int8 for a transformer encoder
    on the CPU when this torch has int8 kernels, else float32; `int8-onnx`: int8 in ONNX Runtime,
    asked for explicitly, so it fails with one line rather than falling back)."""
    if precision not in QUERY_PRECISIONS:
        raise ConfigError(f"query_precision must be one of {list(QUERY_PRECISIONS)}, got {precision!r}")
    transformer = isinstance(getattr(encoder, "model", None), nn.Module)
    on_cpu = getattr(encoder, "device", torch.device("cpu")).type == "cpu"
    kernels = int8_kernels()
    if precision == "auto":
        precision = "int8" if transformer and on_cpu and kernels else "float32"
    if precision == "float32":
        return encoder
    if not transformer:
        raise ConfigError(f"query_precision: int8 needs a transformer encoder; {encoder.name!r} is not one")
    if precision == "int8-onnx":
        from rmm.encoders.onnx_backend import OnnxBackendError

        try:
            onnx_encoder = Int8QueryEncoder(encoder, engine="onnx")
        except OnnxBackendError as err:
            raise ConfigError(f"query_precision: int8-onnx: {err}") from err
        log.info("query encoder %s: int8 in ONNX Runtime (passages stay float32)", encoder.name)
        return onnx_encoder
    if not kernels:
        raise ConfigError("query_precision: int8 needs torch's int8 CPU matmul (torch._int_mm), which this build lacks")
    log.info("query encoder %s: linear layers in int8 (passages stay float32)", encoder.name)
    return Int8QueryEncoder(encoder)
