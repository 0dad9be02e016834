"""`nn.Linear` in int8 with one activation scale per row: the building block of the server's
int8 query path (`rmm.serve.query_encoder`, `rmm.serve.packed_bert`).

Activations are quantized *per token* (one scale per row), not per tensor as torch's dynamic
quantization does: with one scale for the whole input, a query's embedding depended on the other
queries of its micro-batch and on their padding, so a request's ranking changed with whoever else
was asking. With a scale per row the integer matmul (`torch._int_mm`, exact) sees the same numbers
for a row whatever else is in the batch.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["RowInt8Linear", "int8_kernels", "quantize_linears"]

_TINY = 1e-12  # the smallest scale: an all-zero row stays zero instead of dividing by zero


class RowInt8Linear(nn.Module):
    """`nn.Linear` in int8: weights per output channel, each input row quantized with its own
    scale (symmetric, ±127), an exact int32 matmul, then one float rescale per element."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=_TINY) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).T.contiguous())  # [in, out]: what _int_mm takes
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY).div_(127.0)
        quantized = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(quantized, self.weight_int8).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose linear layers run in int8 (`RowInt8Linear`)."""
    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):  # the encoder's oneDNN subclass too
                setattr(module, name, RowInt8Linear(child))
    return copied


def int8_kernels() -> bool:
    """Whether this torch has an int8 CPU matmul (`torch._int_mm` on CPU, torch >= 2.2)."""
    try:
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True
