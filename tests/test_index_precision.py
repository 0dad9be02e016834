"""TorchIndex in half precision or int8: same answers as float32 (exact re-score of a shortlist)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rmm.memory.index import TorchIndex, load_index, make_index


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8"])
def test_half_precision_search_matches_float32(precision: str) -> None:
    vectors, queries = unit(3000, 64, 0), unit(40, 64, 1)
    ids = [f"m{i}" for i in range(len(vectors))]
    exact, half = TorchIndex(64, device="cpu"), make_index("torch", 64, device="cpu", precision=precision)
    exact.add(ids, vectors)
    half.add(ids[:1000], vectors[:1000])
    half.add(ids[1000:], vectors[1000:])  # grows both buffers
    half.remove(ids[:50])  # moves rows in both buffers
    exact.remove(ids[:50])
    want_scores, want_ids = exact.search(queries, 20)
    got_scores, got_ids = half.search(queries, 20)
    assert got_ids == want_ids
    assert torch.allclose(got_scores, want_scores, atol=1e-5)
    assert torch.equal(half.vectors(ids[50:60]), vectors[50:60])  # the float32 rows stay the truth


def test_the_half_scan_alone_would_reorder_the_top_k() -> None:
    """What the exact re-score is for: near-ties that half precision cannot tell apart."""
    base = unit(1, 64, 2)
    near = torch.nn.functional.normalize(base + 3e-2 * unit(12, 64, 3), dim=1)  # 12 near-ties
    vectors = torch.cat([near, unit(188, 64, 5)])
    query = base
    exact = TorchIndex(64, device="cpu")
    half = TorchIndex(64, device="cpu", precision="bfloat16")
    ids = [f"m{i}" for i in range(200)]
    exact.add(ids, vectors)
    half.add(ids, vectors)
    scan = (query.bfloat16() @ vectors.bfloat16().T).float()
    truth = torch.topk(query @ vectors.T, 10).indices
    assert not torch.equal(torch.topk(scan, 10).indices, truth)  # bf16 alone gets the order wrong
    assert half.search(query, 10)[1] == exact.search(query, 10)[1]


def test_precision_survives_save_and_load_and_is_checked(tmp_path: Path) -> None:
    index = TorchIndex(8, device="cpu", precision="bfloat16")
    index.add(["a", "b"], unit(2, 8, 4))
    index.save(tmp_path / "i.safetensors")
    loaded = load_index(tmp_path / "i.safetensors", device="cpu")
    assert isinstance(loaded, TorchIndex) and loaded.precision == "bfloat16"
    assert torch.equal(loaded.vectors(["a", "b"]), index.vectors(["a", "b"]))
    with pytest.raises(ValueError, match="unknown index precision 'int4'"):
        TorchIndex(8, precision="int4")
    with pytest.raises(ValueError, match="no options but 'precision'"):
        make_index("torch", 8, nprobe=4)


def test_int8_scan_keeps_one_scale_per_row_through_growth_and_removal() -> None:
    vectors = unit(300, 32, 6) * torch.linspace(0.1, 10, 300)[:, None]  # rows of very different norms
    ids = [f"m{i}" for i in range(300)]
    index = TorchIndex(32, device="cpu", precision="int8")
    index.add(ids[:70], vectors[:70])
    index.add(ids[70:], vectors[70:])  # grows the int8 rows and their scales
    index.remove(ids[5:40:3])  # moves the last rows (and their scales) into the holes
    kept = [i for i in range(300) if ids[i] in index]
    rows = torch.tensor([index._rows[ids[i]] for i in kept])
    dequantized = index._scan[rows].float() * index._scan_scale[rows].float()[:, None]
    step = vectors[kept].abs().amax(dim=1, keepdim=True) / 127
    assert bool(((dequantized - vectors[kept]).abs() <= 0.51 * step * 1.01).all())  # half a step, bf16 scale
    queries = unit(5, 32, 7)
    exact = TorchIndex(32, device="cpu")
    exact.add([ids[i] for i in kept], vectors[kept])
    assert index.search(queries, 10)[1] == exact.search(queries, 10)[1]


def test_int8_needs_the_cpu_and_a_dimension_its_kernel_takes() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        TorchIndex(24, device="cpu", precision="int8")
