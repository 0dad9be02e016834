"""Token-to-sentence pooling over a padded batch.

Every mode reads the attention mask, so the result for a text does not depend on how much padding
its batch needed, nor on which side the tokenizer padded (gte-style models pad on the left).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rmm.errors import RmmError

POOLING_MODES: tuple[str, ...] = ("mean", "cls", "last", "max")


class EncoderError(RmmError, ValueError):
    """An encoder option, model folder or input the encoder cannot work with."""


def check_pooling_mode(mode: str) -> str:
    if mode not in POOLING_MODES:
        raise EncoderError(f"unknown pooling mode {mode!r}; use one of {list(POOLING_MODES)}")
    return mode


def first_token_index(attention_mask: Tensor) -> Tensor:
    """Position of the first attended token (0 under right padding)."""
    return attention_mask.to(torch.int8).argmax(dim=1)


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Position of the last attended token (T-1 under left padding)."""
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.flip(1).to(torch.int8).argmax(dim=1)


def pool(hidden: Tensor, attention_mask: Tensor, mode: str) -> Tensor:
    """Pool `hidden[B,T,H]` to `[B,H]` in float32 (bf16 sums over long texts lose digits).

    Padded positions are excluded with `where`, not multiplied by 0, because some attention
    kernels leave NaN in fully masked pad rows and NaN * 0 is NaN.
    """
    check_pooling_mode(mode)
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise EncoderError(
            f"pool expects hidden [B,T,H] and attention_mask [B,T]; got {tuple(hidden.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    hidden = hidden.float()
    mask = attention_mask.bool()
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "mean":
        summed = torch.where(mask.unsqueeze(-1), hidden, 0.0).sum(dim=1)
        counts = mask.sum(dim=1, keepdim=True).clamp(min=1).to(hidden.dtype)
        return summed / counts
    if mode == "cls":
        return hidden[rows, first_token_index(mask)]
    if mode == "last":
        return hidden[rows, last_token_index(mask)]
    # max: a text with no tokens at all pools to zeros rather than -inf
    filled = torch.where(mask.unsqueeze(-1), hidden, float("-inf"))
    pooled = filled.max(dim=1).values
    return torch.where(mask.any(dim=1, keepdim=True), pooled, 0.0)
