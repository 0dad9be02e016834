"""What makes the non-LLM topic bank fast without changing it: token-capped batches, each distinct
token sequence run once, a vector cache keyed by token ids (passages, and queries with their
prefix), and merges re-encoded in one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import write_tiny_bert

from rmm.encoders import Encoder, EncoderConfig
from rmm.encoders.passage_cache import PassageCache, attach_cache, token_key
from rmm.errors import CorruptFileError, DimensionMismatchError
from rmm.memory.bank import MemoryBank
from rmm.types import Dataset, Memory, Session, Turn

TEXTS = ["hi", "Caroline: I went to the LGBTQ support group yesterday and it was so powerful.", "Melanie: wow",
         "a somewhat longer sentence about painting a sunrise over the lake with the kids last summer",
         "ok then", "OK then", "hi"]  # the uncased tokenizer reads "ok then" and "OK then" alike


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A 2-layer random BERT with MiniLM's tokenizer (fast, deterministic)."""
    return write_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), minilm_path)


def _encoder(folder: Path, query_prefix: str = "", **options: object) -> Encoder:
    config = EncoderConfig(name="tiny", model_path=folder, max_length=64, query_prefix=query_prefix)
    return Encoder(config, device="cpu", **options)  # type: ignore[arg-type]


class RunCounter:
    """Records every token sequence the model is run on."""

    def __init__(self, encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sequences: list[tuple[int, ...]] = []
        collate = encoder.collate

        def spy(sequences):  # type: ignore[no-untyped-def]
            self.sequences += [tuple(s) for s in sequences]
            return collate(sequences)

        monkeypatch.setattr(encoder, "collate", spy)


# ---- batching -----------------------------------------------------------------------------------
def test_batches_are_longest_first_within_both_caps(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, batch_size=3, max_batch_tokens=20)
    lengths = [5, 30, 4, 6, 6, 2, 9, 1]
    batches = encoder.batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each position once
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True)
    for batch in batches:
        assert len(batch) <= 3
        assert len(batch) == 1 or len(batch) * lengths[batch[0]] <= 20  # padded to the batch's longest
    assert batches[0] == [1]  # longer than the cap: alone


def test_cpu_default_caps_tokens_and_the_vectors_do_not_depend_on_batching(tiny_bert: Path) -> None:
    from rmm.encoders.encoder import CPU_BATCH_TOKENS

    assert _encoder(tiny_bert).max_batch_tokens == CPU_BATCH_TOKENS
    capped = _encoder(tiny_bert, batch_size=64, max_batch_tokens=8).encode_passages(TEXTS)
    whole = _encoder(tiny_bert, batch_size=64, max_batch_tokens=10_000).encode_passages(TEXTS)
    one_by_one = torch.cat([_encoder(tiny_bert).encode_passages([t]) for t in TEXTS])
    assert torch.allclose(capped, whole, atol=1e-5) and torch.allclose(capped, one_by_one, atol=1e-5)
    with pytest.raises(Exception, match="max_batch_tokens"):
        _encoder(tiny_bert, max_batch_tokens=0)


def test_identical_token_sequences_run_once(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = _encoder(tiny_bert)
    runs = RunCounter(encoder, monkeypatch)
    vectors = encoder.encode_passages(TEXTS)
    assert len(runs.sequences) == len(set(runs.sequences)) == 5  # "hi" twice, "ok then" / "OK then"
    assert torch.equal(vectors[0], vectors[6]) and torch.equal(vectors[4], vectors[5])
    assert not torch.equal(vectors[0], vectors[1])


# ---- the passage cache --------------------------------------------------------------------------
def test_cache_answers_the_passages_it_has_seen(tiny_bert: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = _encoder(tiny_bert)
    fresh = encoder.encode_passages(TEXTS)
    encoder.passage_cache = PassageCache.for_encoder(tmp_path, encoder)
    runs = RunCounter(encoder, monkeypatch)
    first = encoder.encode_passages(TEXTS[:3])
    assert len(runs.sequences) == 3 and len(encoder.passage_cache) == 3
    assert torch.allclose(first, fresh[:3], atol=1e-6)
    runs.sequences.clear()
    again = encoder.encode_passages(TEXTS)  # two of the five distinct sequences are new
    assert len(runs.sequences) == 2 and torch.equal(again[:3], first)
    assert torch.allclose(again, fresh, atol=1e-6)
    assert (encoder.passage_cache.hits, encoder.passage_cache.misses) == (3, 5)
    encoder.passage_cache.close()


def test_cache_answers_queries_under_their_own_prefix(tiny_bert: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Query vectors come from the same cache, keyed by the tokens the model reads (prefix included):
    cached = fresh, and a prefixed query never gets the passage vector of the same text."""
    encoder = _encoder(tiny_bert, query_prefix="query: ")
    fresh_queries, fresh_passages = encoder.encode_queries(TEXTS), encoder.encode_passages(TEXTS)
    assert not torch.allclose(fresh_queries, fresh_passages, atol=1e-3)  # the prefix changes the vectors
    cache = attach_cache(encoder, tmp_path)
    assert cache is not None and encoder.passage_cache is cache and cache.path.parent == tmp_path / "passages"
    encoder.encode_passages(TEXTS)
    runs = RunCounter(encoder, monkeypatch)
    first = encoder.encode_queries(TEXTS)
    assert len(runs.sequences) == 5 and torch.allclose(first, fresh_queries, atol=1e-6)
    runs.sequences.clear()
    again = encoder.encode_queries(TEXTS[::-1])
    assert runs.sequences == [] and torch.equal(again, first.flip(0))  # every query from the cache
    cache.close()

    # another process (a new encoder, same weights and prefix) reads the file and runs nothing
    later = _encoder(tiny_bert, query_prefix="query: ")
    reopened = attach_cache(later, tmp_path)
    runs = RunCounter(later, monkeypatch)
    assert torch.equal(later.encode_queries(TEXTS), first) and runs.sequences == []
    assert reopened is not None and (reopened.hits, reopened.misses) == (5, 0)
    reopened.close()

    # another prefix reads other tokens: nothing of the first prefix's queries is reused
    other = _encoder(tiny_bert, query_prefix="search: ")
    attach_cache(other, tmp_path)
    runs = RunCounter(other, monkeypatch)
    other.encode_queries(TEXTS)
    assert len(runs.sequences) == 5


def test_attach_cache_leaves_an_encoder_without_the_hook_alone(tmp_path: Path) -> None:
    encoder = WordEncoder()
    assert attach_cache(encoder, tmp_path) is None and not hasattr(encoder, "passage_cache")
    assert not (tmp_path / "passages").exists()


def test_cache_file_persists_and_refuses_another_identity(tiny_bert: Path, tmp_path: Path) -> None:
    encoder = _encoder(tiny_bert)
    cache = PassageCache.for_encoder(tmp_path, encoder)
    keys = [token_key(ids) for ids in encoder.tokenize(TEXTS[:2])]
    cache.put(keys, encoder.encode_passages(TEXTS[:2]))
    with pytest.raises(ValueError, match="keys"):
        cache.put(keys, torch.zeros(3, encoder.dim))
    cache.close()
    reopened = PassageCache.for_encoder(tmp_path, encoder)
    assert set(reopened.get([*keys, token_key([1, 2, 3])])) == set(keys)
    reopened.close()
    with pytest.raises(CorruptFileError, match="holds vectors of"):
        PassageCache(reopened.path, "another-fingerprint", encoder.dim)
    bf16 = PassageCache.for_encoder(tmp_path, _encoder(tiny_bert, dtype=torch.bfloat16))
    assert bf16.path != reopened.path and len(bf16) == 0  # another dtype never shares vectors
    bf16.close()


def test_two_writers_of_one_file_both_keep_their_vectors(tiny_bert: Path, tmp_path: Path) -> None:
    """Two processes sharing a cache file (two scripts at once) lose nothing of each other's."""
    encoder = _encoder(tiny_bert)
    a, b = PassageCache.for_encoder(tmp_path, encoder), PassageCache.for_encoder(tmp_path, encoder)
    keys = [token_key(ids) for ids in encoder.tokenize(TEXTS[:2])]
    vectors = encoder.encode_passages(TEXTS[:2])
    a.put(keys[:1], vectors[:1])
    b.put(keys[1:], vectors[1:])
    a.close()
    b.close()
    reopened = PassageCache.for_encoder(tmp_path, encoder)
    found = reopened.get(keys)
    assert torch.equal(torch.stack([found[k] for k in keys]), vectors)
    reopened.close()


# ---- merges re-encoded together ---------------------------------------------------------------
class WordEncoder:
    """Bag of words over a fixed vocabulary; counts its calls."""

    name, fingerprint, dim = "words", "words:v1", 4
    VOCAB = ("kayak", "river", "bread", "flour")

    def __init__(self) -> None:
        self.calls = 0

    def _vectors(self, texts: list[str]) -> torch.Tensor:
        rows = [[float(t.lower().count(w)) + 0.01 for w in self.VOCAB] for t in texts]
        return torch.nn.functional.normalize(torch.tensor(rows).reshape(-1, self.dim), dim=-1)

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return self._vectors(texts)

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        self.calls += 1
        return self._vectors(texts)


def test_update_takes_a_precomputed_embedding_for_a_changed_text(tmp_path: Path) -> None:
    encoder = WordEncoder()
    with MemoryBank(tmp_path / "bank", encoder, device="cpu") as bank:
        bank.add("u", [Memory(id="a", user_id="u", kind="topic", text="kayak river")])
        (old,) = bank.get("u", ["a"])
        calls = encoder.calls
        given = torch.tensor([0.0, 0.0, 1.0, 0.0])
        bank.update("u", Memory(**{**old.__dict__, "text": "bread"}), embedding=given)
        assert encoder.calls == calls and torch.equal(bank.embeddings("u", ["a"])[0], given)
        (c,) = bank.search(["bread"], "u", k=1)
        assert torch.equal(c.embeddings[0], given)  # the index holds it too
        with pytest.raises(DimensionMismatchError):
            bank.update("u", Memory(**{**old.__dict__, "text": "flour"}), embedding=torch.zeros(3))
        (kept,) = bank.get("u", ["a"])
        assert kept.text == "bread"  # the refused update stored nothing
        bank.update("u", Memory(**{**kept.__dict__, "refs": ["r"]}), embedding=torch.ones(4))
        assert torch.equal(bank.embeddings("u", ["a"])[0], given)  # same text: the vector stays


# ---- a topic bank after a turn bank -------------------------------------------------------------
def _dataset() -> Dataset:
    lines = ["I paddled my kayak down the river", "The river was fast for a kayak", "Kayak trips on the river",
             "River kayak again today", "I bake bread with rye flour", "Bread needs flour and time",
             "Flour for the bread dough", "More bread and flour baking"]
    sessions = []
    for s in range(3):
        turns = [Turn(id=f"u:S{s}:{i}", session_id=f"u:S{s}", speaker="Ana" if i % 2 else "Ben", text=t)
                 for i, t in enumerate(lines[s % 2 * 4:] + lines[:s % 2 * 4])]
        sessions.append(Session(id=f"u:S{s}", user_id="u", turns=turns, time=f"t{s}"))
    return Dataset("tiny", {"u": sessions}, [])


def test_topic_bank_reads_the_turn_vectors_its_turn_bank_cached(tiny_bert: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from rmm.eval.benchmark_bank import fill, fill_topics, passage_cache
    from rmm.reflection import ProspectiveReflector
    from rmm.reflection.segment import turn_line

    dataset = _dataset()
    lines = {tuple(ids) for ids in _encoder(tiny_bert).tokenize([turn_line(t) for t in dataset.turns("u")])}

    def topics(folder: Path, warm: bool) -> tuple[list[tuple[str, list[str]]], set[tuple[int, ...]]]:
        encoder = _encoder(tiny_bert)
        if warm:
            with MemoryBank(folder / "turns", encoder, device="cpu") as turns, passage_cache(encoder, folder):
                fill(turns, dataset, "turn", progress=False)
        runs = RunCounter(encoder, monkeypatch)
        with MemoryBank(folder / "topics", encoder, device="cpu") as bank, passage_cache(encoder, folder):
            fill_topics(bank, dataset, ProspectiveReflector(bank, None, merge_threshold=0.5), progress=False)
            assert encoder.passage_cache is not None
            built = [(m.text, m.refs) for m in bank.memories("u")]
        assert encoder.passage_cache is None  # attached for the build only
        return built, set(runs.sequences)

    cold, cold_runs = topics(tmp_path / "cold", warm=False)
    warm, warm_runs = topics(tmp_path / "warm", warm=True)
    assert warm == cold and len(cold) >= 2
    assert lines <= cold_runs and not lines & warm_runs  # warm: no turn line went through the model


# ---- a fallback merge into a memory already past max_length -------------------------------------
def _growing_topic() -> list[Session]:
    """Four 3-turn sessions on one subject (too short to cut: one topic each); the first topic is
    ~40 tokens, so the tiny BERT's 64-token limit is crossed by the first merge."""
    sessions = []
    for s in range(4):
        texts = [f"we went hiking on trip {s} up the mountain ridge trail", f"trip {s} on that trail was steep",
                 f"the ridge trail view on trip {s} was worth the hike"]
        turns = [Turn(id=f"u:S{s}:{i}", session_id=f"u:S{s}", speaker="Ana", text=t) for i, t in enumerate(texts)]
        sessions.append(Session(id=f"u:S{s}", user_id="u", turns=turns, time=f"t{s}"))
    return sessions


def test_fallback_merge_past_max_length_reuses_the_stored_vector(tiny_bert: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge that appends only truncated text leaves the memory's token ids, hence its vector, as
    they were: the reflector reuses the stored vector instead of running the model, and the bank it
    builds is the one the old re-encoding built, bit for bit the one built with a passage cache."""
    from rmm.reflection import ProspectiveReflector
    from rmm.reflection.segment import turn_line

    sessions = _growing_topic()

    def build(name: str, *, reencode_all: bool = False, cached: bool = False):  # type: ignore[no-untyped-def]
        ids = iter(f"m{i:03d}" for i in range(1, 100))
        monkeypatch.setattr(Memory, "new_id", staticmethod(lambda: next(ids)))
        encoder = _encoder(tiny_bert)
        runs = RunCounter(encoder, monkeypatch)
        if cached:
            attach_cache(encoder, tmp_path / f"{name}-cache")
        with MemoryBank(tmp_path / name, encoder, device="cpu") as bank:
            reflector = ProspectiveReflector(bank, None, merge_threshold=-1.0)  # every topic merges
            if reencode_all:  # the code before the reuse: every merged memory re-encoded
                monkeypatch.setattr(reflector, "_same_tokens", lambda pairs: [False] * len(pairs))
            reflector.reflect_many(sessions)
            memories = bank.memories("u")
            vectors = bank.embeddings("u", [m.id for m in memories])
        records = [(m.id, m.text, m.kind, m.refs, m.merged_from, m.source_text, m.time_span) for m in memories]
        return records, vectors, runs.sequences, encoder

    reused, vectors, runs, encoder = build("reused")
    old, old_vectors, old_runs, _ = build("old", reencode_all=True)
    cached, cached_vectors, _, _ = build("cached", cached=True)
    (memory,) = reused
    assert reused == old == cached and len(memory[3]) == 12  # one memory, all four sessions merged in
    # the memory's tokens before each merge: S1 appends to 3 turns (< 64 tokens, so its tokens
    # change); S2 and S3 append past the tiny BERT's 64-token limit (its tokens stay)
    lines = [turn_line(t) for s in sessions for t in s.turns]
    before = [len(ids) for ids in encoder.tokenize(["\n".join(lines[:3 * n]) for n in (1, 2, 3)])]
    assert before[0] < 64 and before[1:] == [64, 64]
    fresh = _encoder(tiny_bert).encode_passages([memory[1]])  # the stored vector is its text's
    assert torch.allclose(vectors, fresh, atol=1e-6) and torch.allclose(vectors, old_vectors, atol=1e-6)
    assert torch.equal(vectors, cached_vectors)  # what the passage cache hands back, to the bit
    assert len(old_runs) == 4 + 3 and len(runs) == 4 + 1  # each topic, then only the S1 merge

