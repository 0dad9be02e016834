"""TorchIndex in half precision, int8 or int4: same answers as float32 (exact re-score of a shortlist).

Each kernel is tested as asked (`measured=False`); which one runs where is `test_index_scan_choice.py`'s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rmm.memory.index import TorchIndex, load_index, make_index
from rmm.memory.scans import Int4Scan, Int8Scan, unavailable


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8", "int4"])
def test_half_precision_search_matches_float32(precision: str) -> None:
    vectors, queries = unit(3000, 64, 0), unit(40, 64, 1)
    ids = [f"m{i}" for i in range(len(vectors))]
    exact, half = TorchIndex(64, device="cpu"), TorchIndex(64, device="cpu", precision=precision, measured=False)
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
    assert half.scan_precision == precision
    half.add(["late"], vectors[:1] * 3)  # a write after the scan was built (int8: beyond its range)
    exact.add(["late"], vectors[:1] * 3)
    assert half.search(queries, 20)[1] == exact.search(queries, 20)[1]


def test_the_half_scan_alone_would_reorder_the_top_k() -> None:
    """What the exact re-score is for: near-ties that half precision cannot tell apart."""
    base = unit(1, 64, 2)
    near = torch.nn.functional.normalize(base + 3e-2 * unit(12, 64, 3), dim=1)  # 12 near-ties
    vectors = torch.cat([near, unit(188, 64, 5)])
    query = base
    exact = TorchIndex(64, device="cpu")
    half = TorchIndex(64, device="cpu", precision="bfloat16", measured=False)
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
    with pytest.raises(ValueError, match="unknown index precision 'int2'"):
        TorchIndex(8, precision="int2")
    with pytest.raises(ValueError, match="no options but 'precision'"):
        make_index("torch", 8, nprobe=4)


def test_int8_scan_keeps_one_range_through_growth_and_removal() -> None:
    """faiss's 8-bit codes stay row for row with the float32 rows: a write beyond the range re-encodes
    every row with a wider one, a removal moves the last row's codes into the hole."""
    import faiss

    vectors = unit(300, 32, 6) * torch.linspace(0.1, 10, 300)[:, None]  # rows of very different norms
    ids = [f"m{i}" for i in range(300)]
    index = TorchIndex(32, device="cpu", precision="int8", measured=False)
    index.add(ids[:70], vectors[:70])
    index.search(vectors[:1], 1)  # builds the scan: its range from the first 70 rows
    scan = index._scans["int8"]
    assert isinstance(scan, Int8Scan)
    first = scan.bound
    index.add(ids[70:], vectors[70:])  # larger norms: a wider range, every row re-encoded
    assert scan.bound > first
    index.remove(ids[5:40:3])  # moves the last rows (and their codes) into the holes
    kept = [i for i in range(300) if ids[i] in index]
    rows = torch.tensor([index._rows[ids[i]] for i in kept])
    codes = faiss.vector_to_array(scan._index.codes).reshape(-1, 32)
    assert codes.shape[0] == len(index)
    decoded = torch.from_numpy(scan._index.sa_decode(codes))[rows]
    step = 2 * scan.bound / 255
    assert bool(((decoded - vectors[kept]).abs() <= 0.51 * step).all())  # half a step of the one range
    queries = unit(5, 32, 7)
    exact = TorchIndex(32, device="cpu")
    exact.add([ids[i] for i in kept], vectors[kept])
    assert index.search(queries, 10)[1] == exact.search(queries, 10)[1]


def test_int8_scan_of_zero_rows_then_others() -> None:
    index, exact = TorchIndex(16, device="cpu", precision="int8", measured=False), TorchIndex(16, device="cpu")
    for target in (index, exact):
        target.add(["z0", "z1"], torch.zeros(2, 16))
    assert index.search(unit(1, 16, 1), 2)[1][0] in (["z0", "z1"], ["z1", "z0"])
    index.remove(["z0"])
    exact.remove(["z0"])
    for target in (index, exact):
        target.add(["a", "b"], unit(2, 16, 2))
    assert index.search(unit(3, 16, 3), 3)[1] == exact.search(unit(3, 16, 3), 3)[1]


def test_int8_and_int4_need_the_cpu_and_a_dimension_their_kernels_take() -> None:
    assert "needs the CPU" in str(unavailable("int8", 24, torch.device("cuda")))
    assert TorchIndex(24, device="cpu", precision="int8").precision == "int8"  # faiss's codes take any d
    with pytest.raises(ValueError, match="'int4' needs the CPU and a dimension divisible by 32"):
        TorchIndex(48, device="cpu", precision="int4")
    with pytest.raises(ValueError, match="'auto' is chosen by measurement"):
        TorchIndex(64, device="cpu", precision="auto", measured=False)


def test_int4_codes_dequantize_within_half_a_step_of_each_group() -> None:
    vectors = unit(130, 64, 8) * torch.linspace(0.1, 10, 130)[:, None]
    index = TorchIndex(64, device="cpu", precision="int4", measured=False)
    index.add([f"m{i}" for i in range(130)], vectors)
    index.search(vectors[:1], 1)
    scan = index._scans["int4"]
    assert isinstance(scan, Int4Scan)
    scale, zero = (scan._scales[:130, :, part].float() for part in (0, 1))  # [rows, groups]
    codes = scan._codes[:130].float().view(130, 2, 32)
    dequantized = ((codes - 8) * scale[..., None] + zero[..., None]).view(130, 64)
    groups = vectors.view(130, 2, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert bool(((dequantized - vectors).view(130, 2, 32).abs() <= 0.51 * step[..., None] * 1.02).all())


def test_int4_repacks_only_what_writes_touched_and_answers_like_float32() -> None:
    """Searches between writes of every shape (appends that fill a 64-row block or not, removals
    that move the last row into a hole in an early block) find what float32 finds, and the packed
    rows are always those a fresh pack of the codes gives."""
    generator = torch.Generator().manual_seed(9)
    index, exact = TorchIndex(64, device="cpu", precision="int4", measured=False), TorchIndex(64, device="cpu")
    queries = unit(4, 64, 10)
    added = 0
    for step, (new, removed) in enumerate([(10, []), (60, []), (64, []), (1, ["m3"]), (0, ["m130", "m1"]),
                                           (200, []), (0, [f"m{i}" for i in range(40, 110)])]):
        vectors = torch.nn.functional.normalize(torch.randn(new, 64, generator=generator), dim=1)
        ids = [f"m{added + i}" for i in range(new)]
        added += new
        for target in (index, exact):
            if new:
                target.add(ids, vectors)
            if removed:
                target.remove(removed)
        assert index.search(queries, 10)[1] == exact.search(queries, 10)[1], step
        whole = len(index) // 64 * 64
        scan = index._scans["int4"]
        assert isinstance(scan, Int4Scan)
        if whole:
            fresh = torch.ops.aten._convert_weight_to_int4pack_for_cpu(scan._codes[:whole].to(torch.int32), 1)
            assert scan._packed is not None and torch.equal(scan._packed[0], fresh), step
    assert len(index) == 335 - 73
