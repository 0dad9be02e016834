"""The packed int8 BERT forward: the same transformer as Hugging Face's, without padding, and a
query's vector independent of its micro-batch to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import write_tiny_bert

from rmm.encoders.query.int8_linear import quantize_linears
from rmm.encoders.query.packed_bert import PackedInt8Bert, packable, unpack
from rmm.encoders.query.precision import Int8QueryEncoder

QUERIES = ["Hi", "Where does she hike?", "Which instrument does Ana play in the community orchestra on Fridays?",
           "Dog?", "Who bakes bread?", "What did Ana say about the rehearsal last Thursday with her friends?"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path):
    """A 2-layer random BERT with MiniLM's tokenizer, loaded as an rmm encoder."""
    from rmm.encoders import load_encoder

    return load_encoder(str(write_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), minilm_path, heads=4)), device="cpu")


def test_packed_forward_is_the_hugging_face_forward_with_the_same_int8_layers(tiny_bert) -> None:
    """Each sequence through the packed forward vs through Hugging Face's BertModel (its linear
    layers swapped for the same int8 ones), alone and unpadded: the same numbers up to float
    rounding — positions, attention per sequence, residuals and layer norms are where they belong."""
    reference = quantize_linears(tiny_bert.model).eval()
    sequences = tiny_bert.tokenize(QUERIES)
    packed = PackedInt8Bert(tiny_bert.model)(sequences)
    start = 0
    with torch.inference_mode():
        for sequence in sequences:
            ids = torch.tensor([sequence])
            expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
            got = packed[start:start + len(sequence)]
            start += len(sequence)
            assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), (got - expected).abs().max()
    assert start == packed.shape[0]


def test_a_query_gets_the_same_vector_in_any_batch(tiny_bert) -> None:
    encoder = Int8QueryEncoder(tiny_bert)
    assert encoder._packed is not None
    alone = torch.cat([encoder.encode_queries([q]) for q in QUERIES])
    for batch in (QUERIES, QUERIES[::-1], QUERIES[2:] + QUERIES[:2] + QUERIES[1:3]):
        vectors = encoder.encode_queries(batch)
        for i, query in enumerate(batch):
            assert torch.equal(vectors[i], alone[QUERIES.index(query)])


def test_packed_and_padded_int8_agree(tiny_bert) -> None:
    packed, padded = Int8QueryEncoder(tiny_bert), Int8QueryEncoder(tiny_bert, packed=False)
    assert packed._packed is not None and padded._packed is None
    a, b = packed.encode_queries(QUERIES), padded.encode_queries(QUERIES)
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.9999
    exact = tiny_bert.encode_queries(QUERIES)  # float32: int8 noise only
    assert torch.nn.functional.cosine_similarity(a, exact).min() > 0.99


def test_minilm_packed_int8_ranks_like_float32(minilm_path: Path) -> None:
    from rmm.encoders import load_encoder

    minilm = load_encoder("minilm", device="cpu")
    packed, padded = Int8QueryEncoder(minilm), Int8QueryEncoder(minilm, packed=False)
    exact, quick = minilm.encode_queries(QUERIES), packed.encode_queries(QUERIES)
    assert torch.nn.functional.cosine_similarity(exact, quick).min() > 0.98  # "Hi": 2 tokens, the noisiest
    assert torch.equal((quick @ exact.T).argmax(dim=1), torch.arange(len(QUERIES)))
    assert torch.nn.functional.cosine_similarity(padded.encode_queries(QUERIES), quick).min() > 0.995


def test_what_is_not_plain_bert_is_not_packed(tiny_bert) -> None:
    config = tiny_bert.model.config
    assert packable(tiny_bert.model)
    for field, value in (("position_embedding_type", "relative_key"), ("hidden_act", "gelu_new"),
                         ("is_decoder", True)):
        missing = object()
        old = config.__dict__.get(field, missing)
        setattr(config, field, value)
        try:
            assert not packable(tiny_bert.model)
            encoder = Int8QueryEncoder(tiny_bert)
            assert encoder._packed is None  # the padded int8 path instead
            with pytest.raises(ValueError, match="not a plain BERT"):
                PackedInt8Bert(tiny_bert.model)
        finally:
            if old is missing:
                delattr(config, field)
            else:
                setattr(config, field, old)
    assert not packable(torch.nn.Linear(2, 2))


def test_unpack_pads_with_a_mask() -> None:
    packed = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    hidden, mask = unpack(packed, [1, 3, 2])
    assert hidden.shape == (3, 3, 2) and mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert torch.equal(hidden[1, :3], packed[1:4]) and torch.equal(hidden[2, :2], packed[4:6])
    assert hidden[0, 1:].abs().sum() == 0
