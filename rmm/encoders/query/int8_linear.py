"""`nn.Linear` in int8 with one activation scale per row: the building block of the server's
int8 query path (`rmm.encoders.query.precision`, `rmm.encoders.query.packed_bert`).

Activations are quantized *per token* (one scale per row), not per tensor as torch's dynamic
quantization does: with one scale for the whole input, a query's embedding depended on the other
queries of its micro-batch and on their padding, so a request's ranking changed with whoever else
was asking. With a scale per row the integer matmul (exact) sees the same numbers for a row
whatever else is in the batch.

Two kernels compute the same integer products. `int_mm` (the default) is `torch._int_mm`, the
public, portable one. `onednn` puts layers of `PACKED_MIN_ROWS` rows or more on oneDNN's prepacked
int8 kernel (`onednn::qlinear_pointwise`, the op torch's own x86 quantization lowers to): told that
the input scale is 1, it returns the exact int32 products times each output channel's scale — the
same floats as `torch._int_mm`'s products rescaled, to the bit. It is 1.13-1.23x faster in
micro-batches of 16-32 queries on an Intel Xeon with AMX and ~1,500x slower on an AMD EPYC without
AMX (issue 34's figures), so it runs only where `rmm.encoders.query.choice` measured it faster on
the machine itself (the `int8-onednn` engine), never by default. A row's result is the same on
either kernel and never depends on the other rows.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["INT8_KERNELS", "RowInt8Linear", "int8_kernels", "quantize_linears", "quantize_rows"]

_TINY = 1e-12  # the smallest scale: an all-zero row stays zero instead of dividing by zero
INT8_KERNELS = ("int_mm", "onednn")
PACKED_MIN_ROWS = 32  # with `onednn`, fewer rows (one short query's tokens) go through torch._int_mm: less call overhead
# oneDNN builds (0.4-0.8 ms) and caches a kernel per row count; rows are padded to a multiple of this
# so a server's ever-changing micro-batch sizes reuse a few dozen kernels instead of building new ones
ROW_BLOCK = 16


def _prepacked(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ([out, in] int8) laid out once for oneDNN's int8 matmul, or None where this torch
    has no such kernel (then `torch._int_mm` runs)."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        _packed_matmul(torch.zeros(1, weight.shape[1], dtype=torch.int8), packed,
                       torch.ones(weight.shape[0]), torch.zeros(weight.shape[0], dtype=torch.long))
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed


def _packed_matmul(rows: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                   zero_points: torch.Tensor) -> torch.Tensor:
    """int8 `rows` · prepacked int8 weight → float32 products times each output channel's scale."""
    return torch.ops.onednn.qlinear_pointwise(rows, 1.0, 0, packed, weight_scale, zero_points, None, 1.0, 0,
                                             torch.float32, "none", [], "")


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] float rows → (int8 round(row / scale), scale [n, 1]) with scale = max|row| / 127.

    The largest |value| comes from the row's max and min (two reductions, no |rows| copy) and
    nothing needs clamping (|row / scale| <= 127): on a micro-batch's activations these elementwise
    passes cost more than the int8 matmul itself, and this way there are three of them, not six
    (1.1-1.3x less time for a 240-row layer, the same integers)."""
    largest = torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
    scale = largest.clamp_(min=_TINY).div_(127.0)
    return torch.div(rows, scale).round_().to(torch.int8), scale


class RowInt8Linear(nn.Module):
    """`nn.Linear` in int8: weights per output channel, each input row quantized with its own
    scale (symmetric, ±127), an exact int32 matmul, then one float rescale per element."""

    def __init__(self, linear: nn.Linear, kernel: str = "int_mm") -> None:
        super().__init__()
        if kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=_TINY) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).T.contiguous())  # [in, out]: what _int_mm takes
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        # not buffers: an opaque oneDNN layout (rebuilt from `weight_int8` by `prepack()`)
        self._packed: torch.Tensor | None = None
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.prepack()

    def prepack(self) -> None:
        """Lay the weight out for oneDNN's kernel (after building or after moving the buffers); the
        `int_mm` kernel needs no layout of its own."""
        self._packed = _prepacked(self.weight_int8.T.contiguous()) if self.kernel == "onednn" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized, scale = quantize_rows(x.reshape(-1, self.in_features).float())
        if self._packed is not None and len(quantized) >= PACKED_MIN_ROWS:
            rows = len(quantized)
            padded = nn.functional.pad(quantized, (0, 0, 0, -rows % ROW_BLOCK))  # zero rows, dropped below
            out = _packed_matmul(padded, self._packed, self.weight_scale, self._zero_points)[:rows]
        else:
            out = torch._int_mm(quantized, self.weight_int8).float().mul_(self.weight_scale)
        out = out.mul_(scale) if self.bias is None else torch.addcmul(self.bias, out, scale, out=out)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, kernel: str = "int_mm") -> nn.Module:
    """A copy of `model` whose linear layers run in int8 (`RowInt8Linear` on `kernel`)."""
    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):  # the encoder's oneDNN subclass too
                setattr(module, name, RowInt8Linear(child, kernel))
    return copied


def int8_kernels() -> bool:
    """Whether this torch has an int8 CPU matmul (`torch._int_mm` on CPU, torch >= 2.2)."""
    try:
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True
