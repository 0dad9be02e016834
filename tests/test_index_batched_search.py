"""A search of several query rows at once answers each row as a search of that row alone would."""

from __future__ import annotations

import pytest
import torch

from rmm.memory.index import TorchIndex


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_batched_rows_match_single_row_searches(precision: str) -> None:
    generator = torch.Generator().manual_seed(3)
    vectors = torch.nn.functional.normalize(torch.randn(3000, 64, generator=generator), dim=1)
    index = TorchIndex(64, device="cpu", precision=precision, measured=False)
    index.add([f"m{i}" for i in range(3000)], vectors)
    queries = torch.nn.functional.normalize(torch.randn(9, 64, generator=generator), dim=1)
    for rows in (2, 3, 4, 9):
        scores, ids = index.search(queries[:rows], 20)
        for r in range(rows):
            one_scores, one_ids = index.search(queries[r:r + 1], 20)
            assert ids[r] == one_ids[0]
            torch.testing.assert_close(scores[r], one_scores[0], rtol=1e-5, atol=1e-6)
        exact = torch.topk(queries[:rows] @ vectors.T, 20, dim=1)
        assert [[int(i[1:]) for i in row] for row in ids] == exact.indices.tolist()
