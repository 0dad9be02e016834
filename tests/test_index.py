"""Vector indexes: exact torch, faiss flat / IVF / HNSW — same interface, same answers where exact."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rmm.errors import CorruptFileError, DimensionMismatchError, UnknownMemoryError
from rmm.memory.faiss_index import FaissIndex
from rmm.memory.index import (
    BACKENDS,
    TorchIndex,
    VectorIndex,
    index_file_info,
    load_index,
    make_index,
)

DIM = 16
# Small IVF threshold so the trained path runs on test-sized data.
OPTIONS = {"faiss-ivf": {"train_threshold": 200, "nlist": 8, "nprobe": 8}}


@pytest.fixture(autouse=True, scope="module")
def single_faiss_thread() -> Iterator[None]:
    """faiss's OpenMP threads thrash on a small, shared CPU (HNSW builds of 300 vectors took ~1 s
    with 2 threads vs 25 ms with 1): run faiss single-threaded here, restore afterwards (nothing to
    do where faiss is not installed: the faiss tests skip themselves)."""
    try:
        import faiss
    except ImportError:
        yield
        return

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def unit(n: int, dim: int = DIM, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)


def clustered(n: int, dim: int, clusters: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g) * 3
    labels = torch.randint(0, clusters, (n,), generator=g)
    return torch.nn.functional.normalize(centres[labels] + torch.randn(n, dim, generator=g), dim=1)


def ids_for(n: int, start: int = 0) -> list[str]:
    return [f"m{i}" for i in range(start, start + n)]


def needs_faiss(backend: str = "faiss") -> None:
    """Skip (not fail) a faiss test where faiss is not installed, e.g. a CUDA image without it."""
    if backend.startswith("faiss"):
        pytest.importorskip("faiss")


def build(backend: str, vectors: torch.Tensor) -> VectorIndex:
    needs_faiss(backend)
    index = make_index(backend, vectors.shape[1], device="cpu", **OPTIONS.get(backend, {}))
    index.add(ids_for(len(vectors)), vectors)
    return index


def recall(truth: list[list[str]], found: list[list[str]]) -> float:
    return sum(len(set(t) & set(f)) for t, f in zip(truth, found)) / sum(len(t) for t in truth)


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_is_nearest_and_scores_sorted(backend: str) -> None:
    x = unit(300)
    index = build(backend, x)
    scores, ids = index.search(x[:20], 5)
    assert scores.shape == (20, 5) and scores.dtype == torch.float32
    assert [row[0] for row in ids] == ids_for(20)
    assert torch.allclose(scores[:, 0], torch.ones(20), atol=1e-5)
    assert (scores[:, :-1] >= scores[:, 1:] - 1e-6).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_is_clipped_and_empty_index_returns_nothing(backend: str) -> None:
    needs_faiss(backend)
    index = make_index(backend, DIM, device="cpu", **OPTIONS.get(backend, {}))
    scores, ids = index.search(unit(3), 10)
    assert scores.shape == (3, 0) and ids == [[], [], []]
    index.add(ids_for(4), unit(4))
    scores, ids = index.search(unit(2, seed=1), 10)
    assert scores.shape == (2, 4) and all(sorted(row) == ids_for(4) for row in ids)
    scores, ids = index.search(unit(1)[0], 2)  # a single vector is one query
    assert scores.shape == (1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_and_vectors(backend: str) -> None:
    x = unit(300)
    index = build(backend, x)
    removed = ids_for(100)  # a third: forces the HNSW graph rebuild path too
    index.remove(removed)
    assert len(index) == 200 and "m0" not in index and "m150" in index
    _, ids = index.search(x[:100], 10)
    assert not set(removed) & {i for row in ids for i in row}
    _, ids = index.search(x[150:160], 1)
    assert [row[0] for row in ids] == ids_for(10, 150)
    assert torch.equal(index.vectors(["m299", "m100", "m150"]), x[[299, 100, 150]])
    assert index.vectors([]).shape == (0, DIM)
    index.add(["m0"], x[:1])  # a removed id can be added again
    assert index.search(x[:1], 1)[1] == [["m0"]]
    assert sorted(index.ids) == sorted(ids_for(200, 100) + ["m0"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused(backend: str) -> None:
    index = build(backend, unit(10))
    with pytest.raises(ValueError, match="already"):
        index.add(["m1"], unit(1))
    with pytest.raises(ValueError, match="repeated"):
        index.add(["n", "n"], unit(2))
    with pytest.raises(DimensionMismatchError):
        index.add(["n"], torch.zeros(1, DIM + 1))
    with pytest.raises(ValueError, match="shape"):
        index.add(["n", "o"], unit(1))
    with pytest.raises(DimensionMismatchError):
        index.search(torch.zeros(1, DIM - 1), 3)
    with pytest.raises(UnknownMemoryError):
        index.remove(["m1", "nope"])
    with pytest.raises(UnknownMemoryError):
        index.vectors(["nope"])
    with pytest.raises(ValueError):
        index.search(unit(1), -1)
    assert len(index) == 10  # nothing above changed it


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip(backend: str, tmp_path: Path) -> None:
    x = unit(300)
    index = build(backend, x)
    index.remove(["m3", "m7"])
    index.metadata = {"generation": "7", "user": "alice"}
    path = tmp_path / "idx.safetensors"
    index.save(path)
    loaded = load_index(path, device="cpu")
    assert type(loaded) is type(index) and loaded.metadata == index.metadata
    assert loaded.ids == index.ids and len(loaded) == 298
    s1, i1 = index.search(x[:30], 5)
    s2, i2 = loaded.search(x[:30], 5)
    assert i1 == i2 and torch.allclose(s1, s2)
    info = index_file_info(path)
    assert info["backend"] == backend and info["size"] == 298 and info["metadata"]["generation"] == "7"
    loaded.add(["new"], x[:1])  # still writable (labels continue, no clash)
    assert "new" in loaded and len(loaded) == 299


def test_corrupt_and_foreign_files(tmp_path: Path) -> None:
    needs_faiss()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 50)
    with pytest.raises(CorruptFileError, match=str(bad)):
        load_index(bad)
    good = tmp_path / "good.safetensors"
    build("torch", unit(5)).save(good)
    data = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError):
        load_index(tmp_path / "cut.safetensors")
    with pytest.raises(CorruptFileError, match="not a FaissIndex"):
        FaissIndex.load(good)
    with pytest.raises(FileNotFoundError):
        load_index(tmp_path / "missing.safetensors")


def test_faiss_flat_equals_torch_exact() -> None:
    needs_faiss()
    x, q = unit(2000, 32), unit(50, 32, seed=1)
    exact = build("torch", x)
    flat = build("faiss-flat", x)
    s1, i1 = exact.search(q, 10)
    s2, i2 = flat.search(q, 10)
    assert i1 == i2
    assert torch.allclose(s1, s2, atol=1e-5)


def test_ivf_falls_back_to_flat_below_threshold_then_trains(caplog: pytest.LogCaptureFixture) -> None:
    needs_faiss()
    index = FaissIndex(DIM, "ivf", train_threshold=500, nlist=10)
    with caplog.at_level(logging.INFO, logger="rmm.memory.faiss_index"):
        index.add(ids_for(100), unit(100))
    assert not index.is_trained_ivf and "train_threshold" in caplog.text
    x = unit(100)
    assert index.search(x, 1)[1] == [[i] for i in ids_for(100)]  # exact meanwhile
    index.add(ids_for(500, 100), unit(500, seed=3))
    assert index.is_trained_ivf and len(index) == 600
    assert torch.equal(index.vectors(["m5"]), x[5:6])  # vectors added before training moved over


def test_ivf_and_hnsw_recall_on_clustered_data() -> None:
    needs_faiss()
    data = clustered(4100, 32, clusters=20)  # queries from the same clusters as the data
    x, q = data[:4000], data[4000:]
    truth = build("torch", x).search(q, 10)[1]
    ivf = FaissIndex(32, "ivf", train_threshold=1000, nlist=20, nprobe=4)
    ivf.add(ids_for(4000), x)
    hnsw = FaissIndex(32, "hnsw", hnsw_m=16, ef_search=64)
    hnsw.add(ids_for(4000), x)
    assert ivf.is_trained_ivf
    assert recall(truth, ivf.search(q, 10)[1]) >= 0.9
    assert recall(truth, hnsw.search(q, 10)[1]) >= 0.9


def test_hnsw_masks_removed_until_rebuild() -> None:
    needs_faiss()
    x = unit(400)
    index = FaissIndex(DIM, "hnsw", rebuild_fraction=0.5)
    index.add(ids_for(400), x)
    index.remove(ids_for(50))  # below the rebuild fraction: masked
    assert index._index.ntotal == 400 and len(index) == 350
    assert not set(ids_for(50)) & {i for row in index.search(x[:50], 5)[1] for i in row}
    index.remove(ids_for(200, 50))  # now beyond half: rebuilt from live vectors
    assert index._index.ntotal == 150 and len(index) == 150
    assert index.search(x[300:310], 1)[1] == [[i] for i in ids_for(10, 300)]


def test_torch_swap_removal_keeps_rows_consistent() -> None:
    x = unit(6)
    index = TorchIndex(DIM, device="cpu")
    index.add(ids_for(6), x)
    index.remove(["m1", "m4"])
    index.add(["m6"], x[1:2] * -1)
    assert sorted(index.ids) == ["m0", "m2", "m3", "m5", "m6"]
    assert torch.equal(index.vectors(["m5", "m0", "m6"]), torch.stack([x[5], x[0], -x[1]]))
    for i in (0, 2, 3, 5):
        assert index.search(x[i : i + 1], 1)[1] == [[f"m{i}"]]


def test_make_index_rejects_unknown_backends_and_options() -> None:
    with pytest.raises(ValueError, match="unknown index backend"):
        make_index("annoy", DIM)
    with pytest.raises(ValueError, match="no options"):
        make_index("torch", DIM, nprobe=3)
    with pytest.raises(ValueError):
        TorchIndex(0)


def test_faiss_index_rejects_unknown_kinds() -> None:
    needs_faiss()
    with pytest.raises(ValueError):
        FaissIndex(DIM, "pq")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_index_on_cuda_matches_cpu() -> None:
    x, q = unit(1000, 64), unit(20, 64, seed=1)
    cpu = build("torch", x)
    gpu = TorchIndex(64, device="cuda")
    gpu.add(ids_for(1000), x)
    gpu.remove(["m3"])
    cpu.remove(["m3"])
    s1, i1 = cpu.search(q, 10)
    s2, i2 = gpu.search(q, 10)
    assert i1 == i2 and torch.allclose(s1, s2, atol=1e-4)
    assert s2.device.type == "cpu" and gpu.vectors(["m5"]).device.type == "cpu"
