"""What the rest of rmm needs of an encoder: the protocol every query path and bank accepts."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["EncoderLike"]


class EncoderLike(Protocol):
    """What a bank or a server needs of an encoder (`rmm.encoders.Encoder` satisfies it; so do the
    server's query paths in `rmm.encoders.query`)."""

    name: str
    dim: int
    fingerprint: str

    def encode_queries(self, texts: list[str]) -> torch.Tensor: ...

    def encode_passages(self, texts: list[str]) -> torch.Tensor: ...
