"""The fused rerank step: torch reference vs rmm.policy.sampling, Triton kernel vs reference, dispatch.

The kernel runs here in Triton's CPU interpreter when triton is installed (small sizes: the
interpreter is slow) and compiled on CUDA when a GPU is present (`-m gpu`). Triton reads
TRITON_INTERPRET when it is first imported, so this module sets it before anything imports triton.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import torch

_CUDA = torch.cuda.is_available()
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
if _TRITON_INSTALLED and not _CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from plackett_luce_helpers import naive_pl_logp
from rmm.kernels import dispatch
from rmm.kernels.dispatch import rerank, resolve_backend
from rmm.kernels.reference import (
    gumbel_from_uniform,
    philox_uniform,
    plackett_luce_picks_logp,
    rerank_reference,
    seeded_gumbel,
    stream_gumbel,
)

from rmm.device import default_dtype, resolve_device
from rmm.errors import DimensionMismatchError
from rmm.policy.sampling import gumbel_noise, gumbel_top_m, plackett_luce_logp, top_m


def _kernel_skip_reason() -> str | None:
    if not _TRITON_INSTALLED:
        return "triton is not installed (pip install triton to run the kernel under TRITON_INTERPRET=1)"
    if not dispatch.triton_available():
        return f"triton does not import: {dispatch._triton_import_error()}"
    if _CUDA:
        return None
    if not dispatch.interpreting():
        return "triton was imported before TRITON_INTERPRET=1 could be set; run this file alone"
    return None


KERNEL_SKIP = _kernel_skip_reason()
needs_kernel = pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
KERNEL_DEVICE = "cuda" if _CUDA else "cpu"


def make_problem(batch: int, k: int, dim: int, n: int, seed: int = 0, pad: dict[int, int] | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Random queries, bank and candidate ids; `pad` maps a row to its number of real candidates."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, dim, generator=gen)
    bank = torch.randn(n, dim, generator=gen)
    ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)])
    for row, real in (pad or {}).items():
        ids[row, real:] = -1
    return queries.to(device, dtype), bank.to(device, dtype), ids.to(device)


# ---- Philox: the reference reproduces tl.rand's stream --------------------------------------
def test_philox_known_answers_and_range() -> None:
    # Values of triton.language.rand(seed, offset) from triton 3.9 (checked bit for bit against
    # the interpreter in test_philox_matches_tl_rand).
    u = philox_uniform(0, torch.tensor([5, 6, 7]))
    torch.testing.assert_close(u, torch.tensor([0.9007, 0.5728, 0.6820]), atol=1e-4, rtol=0)
    many = philox_uniform(12345, torch.arange(8000))
    assert many.dtype == torch.float32 and (many >= 0).all() and (many < 1).all()
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005
    assert torch.equal(many, philox_uniform(12345, torch.arange(8000)))
    assert not torch.equal(many[:100], philox_uniform(12346, torch.arange(100)))
    # the high word of the counter matters: offsets 2**32 apart differ
    assert not torch.equal(philox_uniform(1, torch.arange(50)), philox_uniform(1, torch.arange(50) + 2**32))
    with pytest.raises(ValueError, match="seed"):
        philox_uniform(-1, torch.arange(3))


@needs_kernel
def test_philox_matches_tl_rand() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out_ptr, seed, base, BLOCK: tl.constexpr):
        offsets = base + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.rand(seed, offsets))

    for seed, base in ((0, 0), (7, 123), (2**40 + 3, 2**33 + 1), (2**62 - 5, 9)):
        out = torch.empty(64, device=KERNEL_DEVICE)
        draw[(1,)](out, seed, base, BLOCK=64)
        expected = philox_uniform(seed, torch.arange(64, dtype=torch.int64) + base)
        assert torch.equal(out.cpu(), expected), (seed, base)


def test_seeded_gumbel_is_gumbel_distributed() -> None:
    g = seeded_gumbel(3, 200, 100)
    assert g.shape == (200, 100) and torch.isfinite(g).all()
    euler_gamma = 0.5772156649
    assert abs(g.mean().item() - euler_gamma) < 0.03
    assert abs(g.var().item() - math.pi**2 / 6) < 0.06
    torch.testing.assert_close(gumbel_from_uniform(torch.tensor([0.0, 1.0])).isfinite(), torch.tensor([True, True]))


# ---- reference vs rmm.policy.sampling ---------------------------------------------------------------
def test_reference_stream_noise_equals_sampling_gumbel_noise() -> None:
    """Both are the generator's uniforms through the one Gumbel transform; in place or not, the same values."""
    uniforms = torch.rand((4, 9), generator=torch.Generator().manual_seed(11))
    expected = -torch.log(-torch.log(uniforms))
    a = stream_gumbel((4, 9), torch.Generator().manual_seed(11))
    b = gumbel_noise((4, 9), generator=torch.Generator().manual_seed(11))
    assert torch.equal(a, expected) and torch.equal(b, expected)
    fresh = uniforms.clone()
    assert torch.equal(gumbel_from_uniform(fresh, inplace=True), gumbel_from_uniform(uniforms))
    assert torch.equal(fresh, expected) and not torch.equal(uniforms, expected)  # written into its input


@pytest.mark.parametrize("tau", [0.5, 1.3])
def test_reference_agrees_with_sampling(tau: float) -> None:
    queries, bank, ids = make_problem(5, 12, 8, 40, seed=1)
    explored = rerank_reference(queries, bank, ids, 4, tau, explore=True, generator=torch.Generator().manual_seed(2))
    scores = (bank[ids] @ queries.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(explored.scores, scores)
    # the noise is the Gumbel formula on the generator's draws, and the picks the top-4 of s/τ + g
    noise = -torch.log(-torch.log(torch.rand(scores.shape, generator=torch.Generator().manual_seed(2))))
    assert torch.equal(explored.noise, noise)
    assert torch.equal(explored.indices, (explored.scores / tau + noise).topk(4, dim=-1).indices)
    chosen, sampled_noise = gumbel_top_m(scores, 4, tau, generator=torch.Generator().manual_seed(2))
    assert torch.equal(explored.indices, chosen) and torch.equal(sampled_noise, noise)
    torch.testing.assert_close(explored.logp, naive_pl_logp(scores, chosen, tau))
    torch.testing.assert_close(plackett_luce_logp(scores, chosen, tau), naive_pl_logp(scores, chosen, tau))
    greedy = rerank_reference(queries, bank, ids, 4, tau, explore=False)
    assert torch.equal(greedy.indices, scores.topk(4, dim=-1).indices) and greedy.noise is None
    assert torch.equal(greedy.indices, top_m(scores, 4))
    torch.testing.assert_close(greedy.logp, naive_pl_logp(scores, greedy.indices, tau))


def test_reference_padding_agrees_with_sampling_mask() -> None:
    queries, bank, ids = make_problem(3, 10, 6, 30, seed=4, pad={1: 6, 2: 3})
    result = rerank_reference(queries, bank, ids, 5, 0.5, explore=True, seed=9)
    mask = ids >= 0
    assert (result.scores[~mask] == float("-inf")).all() and torch.isfinite(result.scores[mask]).all()
    # row 2 has 3 candidates: its last two picks are -1 with log π 0
    assert result.indices[2, 3:].tolist() == [-1, -1] and result.logp[2, 3:].tolist() == [0.0, 0.0]
    assert (result.indices[:2] >= 0).all()
    for row in range(3):
        real = result.indices[row][result.indices[row] >= 0]
        assert mask[row, real].all() and len(set(real.tolist())) == len(real)
    clean_scores = result.scores.masked_fill(~mask, 0.0)
    expected = naive_pl_logp(clean_scores, result.indices, 0.5, mask)  # the -1 picks of row 2 included
    torch.testing.assert_close(result.logp, expected)
    torch.testing.assert_close(plackett_luce_logp(clean_scores, result.indices, 0.5, mask), expected)
    torch.testing.assert_close(plackett_luce_picks_logp(result.scores, result.indices, 0.5), expected)


def test_seeded_first_pick_follows_softmax_of_scores_over_tau() -> None:
    """Gumbel-top-1 of s/τ + g samples softmax(s/τ): check frequencies over many rows."""
    tau, rows = 0.5, 6000
    q = torch.tensor([[1.0, 0.0]])
    bank = torch.tensor([[0.6, 0.0], [0.3, 0.0], [0.0, 0.0], [-0.4, 0.0]])
    ids = torch.arange(4).repeat(rows, 1)
    result = rerank_reference(q.expand(rows, 2), bank, ids, 2, tau, explore=True, seed=2024)
    freq = torch.bincount(result.indices[:, 0], minlength=4).float() / rows
    expected = torch.softmax(bank[:, 0] / tau, dim=0)
    assert (freq - expected).abs().max() < 0.025, (freq, expected)
    # and log π of the first pick is exactly log softmax at the pick
    torch.testing.assert_close(result.logp[:, 0], torch.log(expected)[result.indices[:, 0]])


def test_greedy_ties_go_to_the_lower_index() -> None:
    q = torch.ones(1, 2)
    bank = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    ids = torch.tensor([[0, 1, 0, 1]])  # duplicates: equal scores
    result = rerank_reference(q, bank, ids, 4, 1.0, explore=False)
    assert result.indices.tolist() == [[1, 3, 0, 2]]


# ---- dispatch --------------------------------------------------------------------------------
def test_dispatch_auto_is_torch_on_cpu_and_seeded_repeatable() -> None:
    queries, bank, ids = make_problem(3, 8, 6, 20, seed=3)
    a = rerank(queries, bank, ids, 3, 0.5, seed=5, explore=True)
    b = rerank(queries, bank, ids, 3, 0.5, seed=5, explore=True)
    assert a.backend == "torch" and torch.equal(a.indices, b.indices) and torch.equal(a.logp, b.logp)
    assert resolve_backend("auto", torch.device("cpu"), 20, 5) == "torch"
    many = rerank(queries.repeat(40, 1), bank, ids.repeat(40, 1), 3, 0.5, explore=True,
                  generator=torch.Generator().manual_seed(1))
    assert len({tuple(r) for r in many.indices.tolist()}) > 3  # exploring varies the picks


def test_dispatch_backend_override_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    queries, bank, ids = make_problem(2, 5, 4, 10)
    with pytest.raises(ValueError, match="backend"):
        rerank(queries, bank, ids, 2, backend="cuda")
    monkeypatch.setenv("RMM_KERNEL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="RMM_KERNEL_BACKEND"):
        rerank(queries, bank, ids, 2)
    monkeypatch.setenv("RMM_KERNEL_BACKEND", "torch")
    assert rerank(queries, bank, ids, 2).backend == "torch"
    monkeypatch.delenv("RMM_KERNEL_BACKEND")
    with pytest.raises(DimensionMismatchError):
        rerank(queries, torch.randn(10, 5), ids, 2)
    with pytest.raises(IndexError, match="ids"):
        rerank(queries, bank, ids.masked_fill(ids == ids[0, 0], 10), 2)
    with pytest.raises(IndexError, match="ids"):
        rerank(queries, bank, ids.masked_fill(ids == ids[0, 0], -2), 2)
    with pytest.raises(TypeError, match="int64"):
        rerank(queries, bank, ids.float(), 2)
    with pytest.raises(ValueError, match="tau"):
        rerank(queries, bank, ids, 2, tau=0.0, explore=True)
    with pytest.raises(ValueError, match="m must be"):
        rerank(queries, bank, ids, -1)
    with pytest.raises(ValueError, match="rows of ids"):
        rerank(queries[:1], bank, ids, 2)
    if not _CUDA and not dispatch.interpreting():
        with pytest.raises(RuntimeError, match="triton"):
            rerank(queries, bank, ids, 2, backend="triton")


def test_dispatch_triton_refuses_sizes_beyond_the_kernel() -> None:
    if not dispatch.triton_available():
        pytest.skip("triton not installed: the size check comes after the import check")
    device = torch.device("cuda") if _CUDA else torch.device("cpu")
    if not _CUDA and not dispatch.interpreting():
        pytest.skip("no CUDA and no interpreter: the device check comes first")
    with pytest.raises(ValueError, match="K <= 256"):
        resolve_backend("triton", device, 257, 5)
    assert resolve_backend("triton", device, 256, 32) == "triton"


def test_dispatch_empty_and_oversized_m() -> None:
    queries, bank, ids = make_problem(2, 3, 4, 10)
    out = rerank(queries, bank, ids, 5, 0.5, seed=1, explore=True)
    assert out.indices.shape == (2, 5) and (out.indices[:, 3:] == -1).all() and (out.logp[:, 3:] == 0).all()
    none = rerank(queries, bank, ids, 0, 0.5, explore=True, seed=1)
    assert none.indices.shape == (2, 0) and none.noise.shape == (2, 3)
    empty = rerank(queries, bank, ids[:, :0], 2, 0.5, explore=False)
    assert empty.scores.shape == (2, 0) and (empty.indices == -1).all()


def _random_mask(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Exclude about a third of each row's candidates (MemR³'s mask of memories already shown)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(ids.shape, generator=gen) > 0.35).to(ids.device)


def test_dispatch_mask_excludes_before_the_top_m_and_logp_is_over_the_rest() -> None:
    queries, bank, ids = make_problem(4, 12, 8, 40, seed=6, pad={3: 7})
    mask = _random_mask(ids, 1)
    mask[2] = False  # a row with nothing left
    for explore in (False, True):
        got = rerank(queries, bank, ids, 5, 0.5, seed=3, explore=explore, mask=mask)
        same = rerank(queries, bank, ids.masked_fill(~mask, -1), 5, 0.5, seed=3, explore=explore)
        assert torch.equal(got.indices, same.indices) and torch.equal(got.logp, same.logp)
        allowed = mask & (ids >= 0)
        for row in range(4):
            picks = got.indices[row][got.indices[row] >= 0]
            assert allowed[row, picks].all() and len(picks) == min(5, int(allowed[row].sum()))
        assert (got.indices[2] == -1).all() and (got.logp[2] == 0).all()
        scores = (bank[ids.clamp(min=0)] @ queries.unsqueeze(-1)).squeeze(-1)
        for row in (0, 1, 3):  # log π of each pick: Plackett–Luce over the unmasked candidates only
            kept = allowed[row].nonzero().flatten()
            position = {int(k): j for j, k in enumerate(kept)}
            order = torch.tensor([[position[int(i)] for i in got.indices[row] if i >= 0]])
            expected = plackett_luce_logp(scores[row, kept][None], order, 0.5)[0]
            torch.testing.assert_close(got.logp[row, : order.shape[1]], expected)
    with pytest.raises(TypeError, match="bool"):
        rerank(queries, bank, ids, 2, 0.5, mask=mask.long())
    with pytest.raises(ValueError, match="mask shape"):
        rerank(queries, bank, ids, 2, 0.5, mask=mask[:, :3])


# ---- the kernel vs the reference (interpreter on CPU, compiled on CUDA) ------------------------
CASES = [  # batch, K, d, N, M, padding
    (1, 1, 8, 3, 1, None),
    (3, 20, 48, 50, 5, {1: 7}),
    (4, 32, 64, 40, 6, {0: 2, 3: 0}),
    (2, 17, 33, 20, 20, None),  # M > K: surplus picks are -1
]


@needs_kernel
@pytest.mark.parametrize("explore", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}K{c[1]}d{c[2]}M{c[4]}")
def test_kernel_matches_reference(case, explore: bool) -> None:
    batch, k, dim, n, m, pad = case
    queries, bank, ids = make_problem(batch, k, dim, n, seed=k + dim, pad=pad, device=KERNEL_DEVICE)
    for seed in (0, 2**35 + 17) if explore else (0,):  # greedy ignores the seed
        got = rerank(queries, bank, ids, m, 0.7, seed=seed, explore=explore, backend="triton")
        ref = rerank(queries, bank, ids, m, 0.7, seed=seed, explore=explore, backend="torch")
        assert got.backend == "triton" and ref.backend == "torch"
        assert got.indices.dtype == torch.int64 and got.indices.shape == (batch, m)
        assert torch.equal(got.indices.cpu(), ref.indices.cpu()), (got.indices, ref.indices)
        finite = torch.isfinite(ref.scores)
        assert torch.equal(torch.isfinite(got.scores), finite)
        torch.testing.assert_close(got.scores[finite], ref.scores[finite], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.logp, ref.logp, rtol=1e-5, atol=1e-4)
        if explore:
            torch.testing.assert_close(got.noise, ref.noise, rtol=1e-5, atol=1e-5)
        else:
            assert got.noise is None


@needs_kernel
@pytest.mark.parametrize("explore", [False, True])
def test_kernel_with_mask_matches_reference(explore: bool) -> None:
    queries, bank, ids = make_problem(3, 20, 32, 50, seed=8, pad={1: 9}, device=KERNEL_DEVICE)
    mask = _random_mask(ids, 2)
    got = rerank(queries, bank, ids, 5, 0.7, seed=21, explore=explore, backend="triton", mask=mask)
    ref = rerank(queries, bank, ids, 5, 0.7, seed=21, explore=explore, backend="torch", mask=mask)
    assert got.backend == "triton" and torch.equal(got.indices.cpu(), ref.indices.cpu())
    torch.testing.assert_close(got.logp, ref.logp, rtol=1e-5, atol=1e-4)
    picks = got.indices.cpu()
    assert all(mask.cpu()[r, picks[r][picks[r] >= 0]].all() for r in range(3))


@needs_kernel
def test_kernel_ties_and_duplicate_ids_follow_the_reference() -> None:
    q = torch.ones(1, 4, device=KERNEL_DEVICE)
    bank = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]], device=KERNEL_DEVICE)
    ids = torch.tensor([[0, 1, 0, 1, -1]], device=KERNEL_DEVICE)
    got = rerank(q, bank, ids, 5, 1.0, explore=False, backend="triton")
    assert got.indices.tolist() == [[1, 3, 0, 2, -1]]
    ref = rerank(q, bank, ids, 5, 1.0, explore=False, backend="torch")
    torch.testing.assert_close(got.logp, ref.logp)


@needs_kernel
def test_kernel_seed_from_generator_is_repeatable() -> None:
    queries, bank, ids = make_problem(2, 16, 16, 30, device=KERNEL_DEVICE)
    a = rerank(queries, bank, ids, 4, 0.5, explore=True, backend="triton", generator=torch.Generator().manual_seed(3))
    b = rerank(queries, bank, ids, 4, 0.5, explore=True, backend="triton", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.noise, b.noise)


# ---- kernel configurations (issue 38): every one the autotuner may choose gives the same answer ----
def _direct(queries, bank, ids, m, tau, *, explore, seed, config):
    """The kernel with one forced configuration, next to the torch reference on the same inputs."""
    from rmm.kernels.triton_rerank import rerank_triton

    got = rerank_triton(queries, bank, ids, m, tau, explore=explore, seed=seed, config=config)
    ref = rerank_reference(queries, bank, ids, m, tau, explore=explore, seed=seed)
    return got, ref


def _assert_same(got, ref, explore: bool) -> None:
    assert torch.equal(got.indices.cpu(), ref.indices.cpu()), (got.indices, ref.indices)
    finite = torch.isfinite(ref.scores)
    assert torch.equal(torch.isfinite(got.scores).cpu(), finite.cpu())
    torch.testing.assert_close(got.scores[finite], ref.scores[finite], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.logp, ref.logp, rtol=1e-5, atol=1e-4)
    if explore:
        torch.testing.assert_close(got.noise, ref.noise, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shape", [(40, 48), (12, 8)], ids=lambda s: f"K{s[0]}d{s[1]}")
def test_kernel_every_candidate_config_matches_reference(shape) -> None:
    """K 40 → BLOCK_K 64: chunks of 8/16/32 leave a partial last chunk; d 48 a partial column block."""
    from rmm.kernels.triton_rerank import RerankConfig, candidate_configs

    k, dim = shape
    queries, bank, ids = make_problem(2, k, dim, 60, seed=5, pad={1: 11}, device=KERNEL_DEVICE)
    extra = [RerankConfig(8, 16, 4, 1), RerankConfig(16, 32, 4, 2), RerankConfig(256, 16, 8, 1),
             RerankConfig(16, 16, 4, 1, True), RerankConfig(256, 32, 8, 1, True)]  # several unrolled blocks
    configs = candidate_configs(k, dim) + extra
    assert len(configs) >= 4
    for i, config in enumerate(configs):
        # exploring checks scores, noise, picks and log π; greedy shares all but the keys
        for explore in (True, False) if i in (0, len(configs) - 1) else (True,):
            got, ref = _direct(queries, bank, ids, 6, 0.7, explore=explore, seed=2**33 + 5, config=config)
            _assert_same(got, ref, explore)


@needs_kernel
def test_kernel_one_chunk_and_many_chunks_agree_with_ties_and_padding() -> None:
    """CHUNK_K == BLOCK_K (scores in registers) and CHUNK_K 8 (read back) pick alike, ties included."""
    from rmm.kernels.triton_rerank import RerankConfig

    q = torch.ones(2, 4, device=KERNEL_DEVICE)
    bank = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0], [-1.0, 0, 0, 0]], device=KERNEL_DEVICE)
    ids = torch.tensor([[0, 1, 0, 1, -1, 2, 1, 0, 2, 2, 1, -1], [-1] * 12], device=KERNEL_DEVICE)
    results = []
    for config in (RerankConfig(16, 16, 4, 1), RerankConfig(8, 16, 4, 1), RerankConfig(4, 16, 4, 1)):
        got, ref = _direct(q, bank, ids, 12, 1.0, explore=False, seed=0, config=config)
        _assert_same(got, ref, explore=False)
        results.append(got.indices.cpu())
    assert results[0][0, :4].tolist() == [1, 3, 6, 10] and (results[0][1] == -1).all()
    assert all(torch.equal(r, results[0]) for r in results)


@needs_kernel
def test_kernel_config_rejects_non_powers_of_two() -> None:
    from rmm.kernels.triton_rerank import RerankConfig, rerank_triton

    queries, bank, ids = make_problem(1, 8, 8, 10, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="powers of two"):
        rerank_triton(queries, bank, ids, 2, 0.5, explore=False, seed=0, config=RerankConfig(6, 16, 4, 1))


@needs_kernel
def test_candidate_configs_fit_registers_and_clamp_to_the_problem() -> None:
    from rmm.kernels.triton_rerank import MAX_TILE, RerankConfig, _fits, _legacy, candidate_configs

    big = candidate_configs(200, 768)
    assert len(big) == len(set(big)) >= 8
    for c in big:
        assert c.chunk_k <= 256 and c.block_d <= 1024 and c.chunk_k * c.block_d <= MAX_TILE
        assert c.chunk_k * c.block_d <= 64 * 32 * c.num_warps
        if c.unroll_d:  # the chunk's whole [CHUNK_K, d] block: at most 128 values a thread
            assert c.chunk_k * c.block_d * -(-768 // c.block_d) <= 128 * 32 * c.num_warps
    assert not _fits(RerankConfig(32, 256, 4, 3, True), 1024) and _fits(RerankConfig(32, 256, 4, 3), 1024)
    assert _legacy(256, 768) in big  # the pre-autotune shape stays a candidate: never slower than before
    assert any(c.chunk_k < 256 and c.block_d == 256 for c in big)  # long contiguous reads are tried
    small = candidate_configs(20, 64)
    assert all(c.chunk_k <= 32 and c.block_d <= 64 for c in small) and len(small) == len(set(small))
    assert {c.block_d for c in candidate_configs(3, 5)} == {16}


@needs_kernel
def test_autotuner_is_keyed_on_k_d_and_batch_class_and_prunes_per_shape() -> None:
    """Built here without a GPU: triton checks the key names; the pruning hook gets triton's call."""
    from rmm.kernels.triton_rerank import _tuned_kernel, batch_class, candidate_configs

    assert [batch_class(b) for b in (1, 63, 64, 511, 512, 1024)] == [0, 0, 1, 1, 2, 2]
    tuned = _tuned_kernel()
    assert tuned.keys == ["K", "D", "batch_class"]
    assert {"K", "D", "batch_class"} <= set(tuned.arg_names)
    tuned.nargs = {"K": 200, "D": 768, "batch_class": 2}
    try:
        pruned = tuned.prune_configs({"EXPLORE": True, "BLOCK_K": 256})
    finally:
        tuned.nargs = None
    got = [(c.kwargs["CHUNK_K"], c.kwargs["BLOCK_D"], c.kwargs["D_STATIC"], c.num_warps, c.num_stages)
           for c in pruned]
    expected = [(c.chunk_k, c.block_d, 768 if c.unroll_d else 0, c.num_warps, c.num_stages)
                for c in candidate_configs(200, 768)]
    assert got == expected and any(c.unroll_d for c in candidate_configs(200, 768))


@needs_kernel
def test_chosen_config_is_recorded_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from rmm.kernels import triton_rerank as tr

    queries, bank, ids = make_problem(2, 24, 20, 30, device=KERNEL_DEVICE)
    with caplog.at_level("DEBUG", logger=tr.__name__):
        for _ in range(2):
            rerank(queries, bank, ids, 3, 0.5, seed=1, explore=True, backend="triton")
    expected = tr._clamp(tr.INTERPRET_CONFIG, 32, 20) if tr._TUNED is None else None
    chosen = tr.config_for(2, 24, 20, queries.dtype)
    assert chosen is not None and (expected is None or chosen == expected)
    assert tr.chosen_configs()[(0, 24, 20, "float32")] == chosen
    assert tr.config_for(1024, 24, 20, queries.dtype) is None  # another batch class: not launched
    forced = tr.RerankConfig(16, 16, 4, 1)
    assert forced != chosen
    tr.rerank_triton(queries, bank, ids, 3, 0.5, explore=False, seed=0, config=forced)
    assert tr.config_for(2, 24, 20, queries.dtype) == chosen  # a forced config is not the kernel's choice
    lines = [r for r in caplog.records if "K=24, d=20" in r.getMessage()]
    assert len(lines) == 1 and str(chosen) in lines[0].getMessage()


@pytest.mark.skipif(_CUDA, reason="a stand-in autotuner over the interpreter; on CUDA the real one runs")
def test_a_tuned_shape_launches_its_choice_without_the_autotuner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuner times a shape's candidates once; later launches of that shape go straight to
    the chosen configuration (its Python per call is what a served batch waits for), with the
    same results."""
    import triton

    from rmm.kernels import triton_rerank as tr

    class StandIn:  # triton's Autotuner as rerank_triton uses it: grid[...](*args) then best_config
        calls = 0
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **consts):
                StandIn.calls += 1
                choice = tr.RerankConfig(4, 16, 4, 1)
                StandIn.best_config = triton.Config({"CHUNK_K": 4, "BLOCK_D": 16, "D_STATIC": 0}, num_warps=4,
                                                    num_stages=1)
                tr._launch(grid[0], args, consts, choice, args[0].shape[1])
            return run

    monkeypatch.setattr(tr, "_TUNED", StandIn())
    monkeypatch.setattr(tr, "_CHOSEN", {})
    queries, bank, ids = make_problem(3, 12, 20, 40, seed=5, pad={1: 7})
    ref = rerank(queries, bank, ids, 4, 0.5, seed=9, explore=True, backend="torch")
    results = [tr.rerank_triton(queries, bank, ids, 4, 0.5, explore=True, seed=9) for _ in range(3)]
    assert StandIn.calls == 1 and tr.config_for(3, 12, 20, bank.dtype) == tr.RerankConfig(4, 16, 4, 1)
    for got in results:
        torch.testing.assert_close(got.scores, ref.scores)
        assert torch.equal(got.indices, ref.indices)
    tr.rerank_triton(queries[:1], bank, ids[:1], 4, 0.5, explore=True, seed=9)  # same batch class: no tuning
    assert StandIn.calls == 1
    wider, wide_bank, wide_ids = make_problem(3, 12, 24, 40, seed=5)
    tr.rerank_triton(wider, wide_bank, wide_ids, 4, 0.5, explore=True, seed=9)  # a new d: tuned once more
    assert StandIn.calls == 2


# ---- CUDA only: real sizes, half-precision banks, the reranker through dispatch ---------------
@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_matches_reference_at_serving_sizes(dtype: torch.dtype) -> None:
    queries, bank, ids = make_problem(64, 200, 768, 5000, seed=1, pad={3: 150}, device="cuda", dtype=dtype)
    for explore in (False, True):
        got = rerank(queries, bank, ids, 5, 0.5, seed=77, explore=explore)
        ref = rerank(queries, bank, ids, 5, 0.5, seed=77, explore=explore, backend="torch")
        assert got.backend == "triton"
        finite = torch.isfinite(ref.scores)
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.scores[finite], ref.scores[finite], rtol=tol, atol=tol)
        # near-ties may swap under different summation orders: compare the picked keys instead
        agree = (got.indices == ref.indices).float().mean().item()
        assert agree > 0.98, agree


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_gpu_every_candidate_config_at_serving_size_and_autotuned_choice() -> None:
    """Compiled on the GPU: each configuration the autotuner may pick agrees with the reference."""
    from rmm.kernels.triton_rerank import candidate_configs, config_for, rerank_triton

    queries, bank, ids = make_problem(64, 200, 768, 5000, seed=2, pad={5: 120}, device="cuda", dtype=torch.bfloat16)
    ref = rerank_reference(queries, bank, ids, 5, 0.5, explore=True, seed=9)
    finite = torch.isfinite(ref.scores)
    for config in candidate_configs(200, 768):
        got = rerank_triton(queries, bank, ids, 5, 0.5, explore=True, seed=9, config=config)
        torch.testing.assert_close(got.scores[finite], ref.scores[finite], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.noise, ref.noise)
        assert (got.indices == ref.indices).float().mean().item() > 0.98, config
    tuned = rerank_triton(queries, bank, ids, 5, 0.5, explore=True, seed=9)
    assert config_for(64, 200, 768, torch.bfloat16) in candidate_configs(200, 768)
    assert (tuned.indices == ref.indices).float().mean().item() > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_gpu_reranker_select_runs_the_kernel() -> None:
    from rmm.policy.reranker import ResidualLinearReranker
    from rmm.types import Candidates

    assert resolve_backend("auto", torch.device("cuda"), 20, 5) == "triton"
    reranker = ResidualLinearReranker(32).cuda()
    gen = torch.Generator().manual_seed(0)
    cands = []
    for i, k in enumerate((20, 7, 20)):
        q, m = torch.randn(32, generator=gen), torch.randn(k, 32, generator=gen)
        cands.append(Candidates("q", [f"{i}-{j}" for j in range(k)], m @ q, m, q, user_id="u"))
    sels = reranker.select(cands, 5, explore=True, generator=torch.Generator().manual_seed(1))
    assert [len(s.chosen) for s in sels] == [5, 5, 5]
    for sel in sels:
        expected = plackett_luce_logp(sel.scores[None], torch.tensor([sel.chosen]), 0.5)[0]
        torch.testing.assert_close(sel.logp, expected, rtol=1e-4, atol=1e-4)
    greedy = reranker.select(cands, 5)
    for sel, c in zip(greedy, cands):
        assert sel.chosen == torch.argsort(c.retriever_scores, descending=True)[:5].tolist()


# ---- device="auto" on CPU ------------------------------------------------------------------------
def test_device_auto_resolves_by_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert default_dtype(torch.device("cpu")) == torch.float32
    with pytest.raises(RuntimeError, match="CUDA"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_auto_device_components_run_on_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from rmm.memory.index import TorchIndex
    from rmm.policy.learner import Learner
    from rmm.policy.reranker import ResidualLinearReranker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    index = TorchIndex(4, device="auto")
    assert index.device == torch.device("cpu")
    index.add(["a", "b"], torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    scores, ids = index.search(torch.tensor([[0.2, 0.9, 0, 0]]), 1)
    assert ids == [["b"]] and scores.device.type == "cpu"
    learner = Learner(ResidualLinearReranker(4), device="auto")
    assert learner.device == torch.device("cpu") and learner.reranker.W_q.weight.device.type == "cpu"
