"""Test doubles shared by several test files (importable because conftest puts tests/ on sys.path)."""

from __future__ import annotations

import builtins
import hashlib
import re

import torch

DIM = 64


class BagOfWordsEncoder:
    """Hashes words longer than three letters into DIM buckets: shared words → similar vectors."""

    name, dim, fingerprint = "bow", DIM, "bow-v1"

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), DIM)
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z]+", text.lower()):
                if len(word) > 3:
                    out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
        return torch.nn.functional.normalize(out + 1e-4, dim=-1)

    encode_passages = encode_queries


def drive(monkeypatch, lines: list[str]) -> None:
    """Feed `lines` to `input()` (a terminal session), then EOF."""
    feed = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
