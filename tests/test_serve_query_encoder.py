"""The server's int8 query path: faster queries, the same passages, the same ranking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder

from rmm.errors import ConfigError
from rmm.serve.config import load_config
from rmm.serve.query_encoder import Int8QueryEncoder, query_encoder

FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy"]
QUESTIONS = ["Where does she hike?", "Who bakes bread?", "Which instrument does Ana play?", "Does she have a dog?"]


def quantized_linears(model: torch.nn.Module) -> int:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return sum(isinstance(module, DynamicLinear) for module in model.modules())


@pytest.fixture(scope="module")
def minilm(minilm_path: Path):
    from rmm.encoders import load_encoder

    return load_encoder("minilm", device="cpu")


def test_int8_queries_rank_like_float32_and_passages_are_untouched(minilm) -> None:
    fast = query_encoder(minilm, "auto")  # a transformer on the CPU: int8
    assert isinstance(fast, Int8QueryEncoder) and fast.fingerprint == minilm.fingerprint and fast.dim == 384
    assert quantized_linears(fast._queries.model) == 6 * 6 + 1 and quantized_linears(minilm.model) == 0  # + pooler
    passages = minilm.encode_passages(FACTS)
    assert torch.equal(fast.encode_passages(FACTS), passages)  # what the bank stores does not change
    exact, quick = minilm.encode_queries(QUESTIONS), fast.encode_queries(QUESTIONS)
    assert torch.nn.functional.cosine_similarity(exact, quick).min() > 0.95
    assert torch.equal((quick @ passages.T).argmax(dim=1), (exact @ passages.T).argmax(dim=1))
    assert torch.equal((exact @ passages.T).argmax(dim=1), torch.arange(4))


def test_precision_choices(minilm) -> None:
    bow = BagOfWordsEncoder()
    assert query_encoder(bow, "auto") is bow and query_encoder(minilm, "float32") is minilm
    with pytest.raises(ConfigError, match="needs a transformer encoder"):
        query_encoder(bow, "int8")
    with pytest.raises(ConfigError, match="query_precision must be one of"):
        query_encoder(minilm, "int4")
    with pytest.raises(ConfigError, match="query_precision must be"):
        load_config(None, {"bank": "/tmp/x", "query_precision": "fp8"}, environ={})
