"""A BERT forward over a micro-batch's tokens packed into one matrix, in int8: the server's query
path for BERT-family encoders (MiniLM, Contriever) on a CPU.

Every op of a BERT layer except attention works token by token, so the queries of a micro-batch
need no padding at all: their tokens are stacked into one [tokens, hidden] matrix and each linear
layer is one integer matmul over all of them (`RowInt8Linear`; query, key and value fused into
one, since they read the same input). Only attention looks across tokens, and it runs on the
sequences of each exact length together, with no mask. Compared with padding each query to a
multiple of 8 and running one forward per padded length, this does less arithmetic (no pad
tokens), bigger matmuls and one pass through the layers per micro-batch
(`rmm/bench/query_encoder.py` measures it).

A query's numbers depend only on its own tokens: every row of a matmul, a layer norm or the GELU
is computed alone, and attention over L tokens is the same call for a query alone or beside
others of length L — so a query's embedding is the same, to the bit, in any micro-batch
(`tests/test_packed_bert.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rmm.encoders.query.int8_linear import RowInt8Linear

__all__ = ["PackedInt8Bert", "packable", "unpack"]


def packable(model: nn.Module) -> bool:
    """Whether `model` is a plain BERT encoder this forward reproduces (absolute positions, exact
    GELU, post-layer-norm, no cross-attention)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) == "bert"
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and getattr(config, "hidden_act", None) == "gelu"
            and not getattr(config, "is_decoder", False)
            and not getattr(config, "add_cross_attention", False)
            and hasattr(model, "embeddings") and hasattr(model, "encoder"))


@dataclass
class _Layer:
    qkv: RowInt8Linear
    attention_out: RowInt8Linear
    attention_norm: nn.LayerNorm
    up: RowInt8Linear
    down: RowInt8Linear
    output_norm: nn.LayerNorm


def _fused(*linears: nn.Linear, kernel: str) -> RowInt8Linear:
    """One int8 linear computing all of `linears` (outputs concatenated): the input is quantized
    once, and the weights keep one scale per output channel, so each part equals its own layer."""
    weight = torch.cat([linear.weight.detach().float() for linear in linears])
    bias = torch.cat([linear.bias.detach().float() for linear in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        fused.weight.copy_(weight)
        fused.bias.copy_(bias)
    return RowInt8Linear(fused, kernel)


class PackedInt8Bert:
    """`__call__(sequences)` → the last hidden states of each token-id list, packed [tokens, hidden]
    in the order given (`unpack` turns them into [B, T, hidden] for pooling)."""

    def __init__(self, model: nn.Module, kernel: str = "int_mm") -> None:
        if not packable(model):
            raise ValueError(f"not a plain BERT encoder: {type(model).__name__}")
        config: Any = model.config
        embeddings: Any = model.embeddings
        self.heads = int(config.num_attention_heads)
        self.hidden = int(config.hidden_size)
        self.word = embeddings.word_embeddings.weight.detach().float()
        self.positions = embeddings.position_embeddings.weight.detach().float()
        self.token_type = embeddings.token_type_embeddings.weight.detach().float()[0]
        self.embedding_norm = embeddings.LayerNorm
        self.layers = []
        for layer in model.encoder.layer:
            attention: Any = layer.attention
            self.layers.append(_Layer(
                qkv=_fused(attention.self.query, attention.self.key, attention.self.value, kernel=kernel),
                attention_out=RowInt8Linear(attention.output.dense, kernel), attention_norm=attention.output.LayerNorm,
                up=RowInt8Linear(layer.intermediate.dense, kernel), down=RowInt8Linear(layer.output.dense, kernel),
                output_norm=layer.output.LayerNorm))

    @torch.inference_mode()
    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        lengths = [len(s) for s in sequences]
        order = sorted(range(len(sequences)), key=lambda i: lengths[i])  # equal lengths side by side
        groups: list[tuple[int, int, int]] = []  # (first packed row, sequences, length)
        start = 0
        for i in order:
            length = lengths[i]
            if groups and groups[-1][2] == length:
                first, count, _ = groups[-1]
                groups[-1] = (first, count + 1, length)
            else:
                groups.append((start, 1, length))
            start += length
        ids = torch.tensor([token for i in order for token in sequences[i]], dtype=torch.long)
        positions = torch.cat([torch.arange(lengths[i]) for i in order])
        x = self.word[ids] + self.token_type + self.positions[positions]
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = self._layer(layer, x, groups)
        packed = torch.empty_like(x)  # back to the order given
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        src = 0
        for i in order:
            packed[offsets[i]:offsets[i] + lengths[i]] = x[src:src + lengths[i]]
            src += lengths[i]
        return packed

    def _layer(self, layer: _Layer, x: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
        head_dim = self.hidden // self.heads
        qkv = layer.qkv(x)
        attended = torch.empty_like(x)
        for first, count, length in groups:
            rows = qkv[first:first + count * length].view(count, length, 3, self.heads, head_dim)
            q, k, v = (rows[:, :, part].transpose(1, 2) for part in range(3))  # [count, heads, length, head_dim]
            out = nn.functional.scaled_dot_product_attention(q, k, v)
            attended[first:first + count * length] = out.transpose(1, 2).reshape(count * length, self.hidden)
        # in place on each linear's fresh output (the same floats, one allocation and pass fewer each)
        x = layer.attention_norm(layer.attention_out(attended).add_(x))
        return layer.output_norm(layer.down(torch.ops.aten.gelu_(layer.up(x))).add_(x))


def unpack(packed: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed hidden states → ([B, T, hidden] right-padded with zeros, attention mask [B, T])."""
    longest = max(lengths)
    hidden = packed.new_zeros(len(lengths), longest, packed.shape[1])
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    start = 0
    for row, length in enumerate(lengths):
        hidden[row, :length] = packed[start:start + length]
        mask[row, :length] = 1
        start += length
    return hidden, mask
