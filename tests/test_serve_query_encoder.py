"""The server's int8 query path: faster queries, the same passages, the same ranking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder

from rmm.errors import ConfigError
from rmm.serve.config import load_config
from rmm.encoders.query.int8_linear import quantize_rows
from rmm.encoders.query.precision import Int8QueryEncoder, RowInt8Linear, build_engine

FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy"]
QUESTIONS = ["Where does she hike?", "Who bakes bread?", "Which instrument does Ana play?", "Does she have a dog?"]


def quantized_linears(model: torch.nn.Module) -> int:
    return sum(isinstance(module, RowInt8Linear) for module in model.modules())


@pytest.fixture(scope="module")
def minilm(minilm_path: Path):
    from rmm.encoders import load_encoder

    return load_encoder("minilm", device="cpu")


def test_int8_queries_rank_like_float32_and_passages_are_untouched(minilm) -> None:
    fast = build_engine(minilm, "int8")
    assert isinstance(fast, Int8QueryEncoder) and fast.fingerprint == minilm.fingerprint and fast.dim == 384
    assert fast._packed is not None and len(fast._packed.layers) == 6  # BERT: the packed int8 forward
    assert quantized_linears(minilm.model) == 0
    padded = Int8QueryEncoder(minilm, packed=False)
    assert quantized_linears(padded._queries.model) == 6 * 6 + 1  # + pooler
    passages = minilm.encode_passages(FACTS)
    assert torch.equal(fast.encode_passages(FACTS), passages)  # what the bank stores does not change
    exact, quick = minilm.encode_queries(QUESTIONS), fast.encode_queries(QUESTIONS)
    assert torch.nn.functional.cosine_similarity(exact, quick).min() > 0.95
    assert torch.equal((quick @ passages.T).argmax(dim=1), (exact @ passages.T).argmax(dim=1))
    assert torch.equal((exact @ passages.T).argmax(dim=1), torch.arange(4))


def test_precision_choices(minilm) -> None:
    bow = BagOfWordsEncoder()
    assert build_engine(bow, "float32") is bow and build_engine(minilm, "float32") is minilm
    with pytest.raises(ConfigError, match="needs a transformer encoder"):
        build_engine(bow, "int8")
    with pytest.raises(ConfigError, match="query_precision must be one of"):
        build_engine(minilm, "int4")
    with pytest.raises(ConfigError, match="query_precision must be"):
        load_config(None, {"bank": "/tmp/x", "query_precision": "fp8"}, environ={})


def test_int8_query_vector_does_not_depend_on_its_batch(minilm) -> None:
    """A query encoded alone and inside batches of other (longer, shorter) queries gets the very
    same vector: a request's ranking must not change with whoever else is asking."""
    fast = build_engine(minilm, "int8")
    others = ["Hi", "What did Ana say about the orchestra rehearsal she had last Thursday evening with her friends?",
              "Dog?", "Which trail near the lake did she hike with her sister during the long weekend in May?"]
    alone = torch.cat([fast.encode_queries([q]) for q in QUESTIONS])
    for batch in (QUESTIONS + others, others[:2] + QUESTIONS[::-1] + others[2:]):
        vectors = fast.encode_queries(batch)
        assert all(torch.equal(vectors[batch.index(q)], alone[i]) for i, q in enumerate(QUESTIONS))
    assert fast.encode_queries([]).shape == (0, 384)


def test_row_int8_linear_is_close_to_float_and_rowwise() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    quantized = RowInt8Linear(linear)
    x = torch.randn(5, 7, 64)
    exact, approx = linear(x), quantized(x)
    assert approx.shape == (5, 7, 32)
    assert torch.nn.functional.cosine_similarity(exact.reshape(-1, 32), approx.reshape(-1, 32)).min() > 0.999
    assert torch.equal(quantized(x[1:2, 3:4]), approx[1:2, 3:4])  # a row's output ignores the other rows
    assert torch.equal(quantized(torch.zeros(2, 64)), linear.bias.detach().expand(2, 32))  # zero rows: no 0/0


def test_rows_are_quantized_by_their_largest_magnitude() -> None:
    """round(x / (max|x| / 127)) per row, whichever sign holds the largest magnitude, never past
    ±127, a zero row to zeros: the integer matmul sees exactly these numbers."""
    torch.manual_seed(2)
    x = torch.randn(6, 48) * torch.tensor([[1.0], [1e-3], [1e4], [1.0], [1e-30], [0.0]])
    x[3] = x[3].abs()
    x[3, 5] = -10.0  # the largest magnitude is negative
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    expected = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    assert expected.abs().amax(dim=1)[:4].eq(127).all() and expected[3, 5] == -127
    quantized, got_scale = quantize_rows(x)
    assert torch.equal(quantized, expected) and torch.equal(got_scale, scale)
    assert not quantized[5].any()


def test_packed_matmuls_see_few_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN builds a kernel per row count: micro-batches of 33-64 rows reach it as 48 or 64 rows
    (zero rows padded on, their outputs dropped), and each row's result is the unpadded one."""
    from rmm.encoders.query import int8_linear

    torch.manual_seed(3)
    quantized = RowInt8Linear(torch.nn.Linear(64, 32), "onednn")
    if quantized._packed is None:
        pytest.skip("this torch has no oneDNN int8 kernel (torch._int_mm path only)")
    seen: set[int] = set()
    real = int8_linear._packed_matmul

    def spy(rows: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        seen.add(len(rows))
        return real(rows, *args)

    x = torch.randn(64, 64)
    alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])
    monkeypatch.setattr(int8_linear, "_packed_matmul", spy)
    for rows in range(33, 65):
        assert torch.equal(quantized(x[:rows]), alone[:rows]), rows
    assert seen == {48, 64}


def test_row_int8_linear_kernels_agree_to_the_bit_at_every_batch_size() -> None:
    """Rows below PACKED_MIN_ROWS take torch._int_mm, more take oneDNN's prepacked kernel: a query
    alone and the same query in a micro-batch must still get the same floats."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(384, 96)
    quantized = RowInt8Linear(linear, "onednn")
    if quantized._packed is None:
        pytest.skip("this torch has no oneDNN int8 kernel (torch._int_mm path only)")
    x = torch.randn(300, 384) * torch.rand(300, 1) * 4
    alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])  # one row: torch._int_mm
    for rows in (2, 3, 7, 16, 31, 32, 33, 64, 129, 300):  # oneDNN picks kernels by shape: none may change a row
        assert torch.equal(quantized(x[:rows]), alone[:rows]), rows
    portable = RowInt8Linear(linear)  # the default kernel: torch._int_mm for every batch
    assert portable._packed is None and torch.equal(portable(x), alone)
