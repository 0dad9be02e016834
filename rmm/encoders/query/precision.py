"""The server's query path on CPU in int8: the cost every retrieve request pays.

Under load the server's time goes mostly to encoding queries (a MiniLM forward pass per
micro-batch). Running the transformer's linear layers in int8 (weights per output channel,
activations quantized on the fly, integer matmul) roughly halves that on a CPU. Only queries
take this path: passages — what the bank stores — are still encoded in float32, so a bank is
served the same with or without it and nothing stored changes. `research/recall_query_encoder.py`
measures what it costs in recall on LoCoMo (`configs/serve.yaml` quotes the figure).

Activations are quantized *per token* (one scale per row), not per tensor as torch's dynamic
quantization does: with one scale for the whole input, a query's embedding depended on the other
queries of its micro-batch and on their padding (cosine 0.96 between a query encoded alone and in
a batch of 32 LoCoMo questions), so a request's ranking changed with whoever else was asking.
With a scale per row the integer matmul (`torch._int_mm`, exact) sees the same numbers for a
query whatever its batch; what is left is float rounding of the attention over padded lengths
(as float32 has), which can flip an activation's rounding to int8 now and then
(`research/recall_query_batching.py` measures both against float32 and alone vs batched).

The engines (`QUERY_ENGINES`): `float32` (the encoder itself); `int8` (torch, the packed forward
of `rmm.encoders.query.packed_bert` for a plain BERT, else padded; every linear on the portable
`torch._int_mm`); `int8-onednn` (the same with layers of 32+ rows on oneDNN's prepacked kernel);
`int8-padded` (each query padded to a multiple of 8 tokens, one forward per length); `int8-onnx`
(the same scheme as an ONNX graph in ONNX Runtime, `rmm.encoders.onnx_backend`, when onnxruntime
is installed: the `rmm[onnx]` extra). Which is fastest depends on the CPU by orders of magnitude
(oneDNN's int8 kernel: 1.2x faster on an Intel Xeon with AMX, ~1,500x slower on an AMD EPYC), so
`auto` is chosen by `rmm.encoders.query.choice`, which times them on the machine itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rmm.errors import ConfigError
from rmm.encoders.protocol import EncoderLike
from rmm.encoders.query.int8_linear import RowInt8Linear, int8_kernels, quantize_linears
from rmm.encoders.query.packed_bert import PackedInt8Bert, packable, unpack

__all__ = ["QUERY_ENGINES", "QUERY_PRECISIONS", "Int8QueryEncoder", "RowInt8Linear", "build_engine", "quantize_linears"]


QUERY_ENGINES = ("float32", "int8", "int8-onednn", "int8-padded", "int8-onnx")
QUERY_PRECISIONS = ("auto", *QUERY_ENGINES)  # auto: the fastest engine measured here (rmm.encoders.query.choice)
PAD_MULTIPLE = 8  # queries are padded to a multiple of this many tokens (see Int8QueryEncoder.encode_queries)


class Int8QueryEncoder:
    """An `rmm.encoders.Encoder` whose queries go through an int8 copy of its model; passages,
    name, dimension and fingerprint are the float encoder's (the bank sees the same encoder).

    `engine` runs the int8 model: `torch` (`RowInt8Linear` layers) or `onnx` (the same scheme as
    a cached ONNX graph in ONNX Runtime; raises `OnnxBackendError` when that cannot run). With
    `torch`, a plain BERT encoder (MiniLM, Contriever) runs packed — a micro-batch's tokens without
    padding, one pass (`rmm.encoders.query.packed_bert`); `packed=False` or any other model pads each query
    to a multiple of `PAD_MULTIPLE` tokens instead; `kernel` is the int8 matmul
    (`rmm.encoders.query.int8_linear.INT8_KERNELS`).
    """

    def __init__(self, encoder: Any, engine: str = "torch", *, packed: bool = True, kernel: str = "int_mm") -> None:
        if getattr(encoder, "device", torch.device("cpu")).type != "cpu":
            raise ConfigError("query_precision: int8 runs on the CPU; the encoder is on "
                              f"{encoder.device} (use float32 there)")
        if engine not in ("torch", "onnx"):
            raise ConfigError(f"int8 engine must be 'torch' or 'onnx', got {engine!r}")
        self.inner = encoder
        self.name, self.dim, self.fingerprint = encoder.name, int(encoder.dim), encoder.fingerprint
        self.engine, self.kernel = engine, kernel
        self._queries = copy.copy(encoder)  # shares the tokenizer, config and dense head
        if engine == "onnx":
            from rmm.encoders.onnx_backend import open_graph

            self._forward: Callable[[dict[str, torch.Tensor]], torch.Tensor] = open_graph(encoder, "int8-rows")
        self._packed: PackedInt8Bert | None = None
        if engine == "torch" and packed and packable(encoder.model):
            self._packed = PackedInt8Bert(encoder.model, kernel)
        elif engine == "torch":
            self._queries.model = quantize_linears(encoder.model, kernel)
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


def build_engine(encoder: EncoderLike, engine: str) -> EncoderLike:
    """The query encoder `engine` (one of `QUERY_ENGINES`) over `encoder`, whose passages, name and
    fingerprint it keeps; `ConfigError` (one line, the reason) where it cannot run here."""
    if engine not in QUERY_ENGINES:
        raise ConfigError(f"query_precision must be one of {list(QUERY_PRECISIONS)}, got {engine!r}")
    if engine == "float32":
        return encoder
    if not isinstance(getattr(encoder, "model", None), nn.Module):
        raise ConfigError(f"query_precision: {engine} needs a transformer encoder; {encoder.name!r} is not one")
    if engine == "int8-onnx":
        from rmm.encoders.onnx_backend import OnnxBackendError

        try:
            return Int8QueryEncoder(encoder, engine="onnx")
        except OnnxBackendError as err:
            raise ConfigError(f"query_precision: int8-onnx: {err}") from err
    if not int8_kernels():
        raise ConfigError(f"query_precision: {engine} needs torch's int8 CPU matmul (torch._int_mm), which this build lacks")
    kernel = "onednn" if engine == "int8-onednn" else "int_mm"
    fast = Int8QueryEncoder(encoder, packed=engine != "int8-padded", kernel=kernel)
    if kernel == "onednn" and not _on_onednn(fast):
        raise ConfigError("query_precision: int8-onednn needs oneDNN's int8 kernel (onednn::qlinear_prepack), "
                          "which this torch lacks")
    return fast


def _on_onednn(fast: Int8QueryEncoder) -> bool:
    """Whether `fast`'s linear layers really got oneDNN's prepacked weights."""
    layers = fast._packed.layers if fast._packed is not None else []
    modules = [layer.qkv for layer in layers] or list(fast._queries.model.modules())
    return any(isinstance(m, RowInt8Linear) and m._packed is not None for m in modules)
