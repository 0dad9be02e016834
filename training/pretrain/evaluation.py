"""Held-out recall of an encoder (before and after pretraining), optionally with the online reranker on top."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rmm.encoders import Encoder
from rmm.training.pretrain.data import restrict
from rmm.training.pretrain.module import sync_encoder_device
from rmm.training.pretrain_config import PretrainConfig
from rmm.types import Dataset


def evaluate_heldout(encoder: Encoder, dataset: Dataset, users: Sequence[str], ks: Sequence[int],
                     bank_dir: Path, *, train_users: Sequence[str] = (), rerank: PretrainConfig | None = None,
                     progress: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Recall@ks of `encoder` on the held-out users' questions (bank of those users only, plus the
    training users when the online reranker is trained on top), and, with `rerank`, the reranker's
    held-out recall after online training on the training users' questions."""
    from rmm.eval.benchmark_bank import fill
    from rmm.eval.retrieval import evaluate
    from rmm.memory.bank import MemoryBank

    sync_encoder_device(encoder)
    bank_users = list(users) + ([u for u in train_users if u not in users] if rerank else [])
    subset = restrict(dataset, bank_users)
    test = restrict(dataset, users)
    with MemoryBank(bank_dir, encoder, device=str(encoder.device)) as bank:
        fill(bank, subset, "turn", progress=progress)
        report = evaluate(test, bank, "turn", ks, retriever_name=encoder.name, progress=progress)
        retrieval = {**report.overall, "by_category": report.by_category}
        reranked: dict[str, Any] = {}
        if rerank is not None:
            reranked = _online_rerank(subset, bank, list(train_users), list(users), rerank, progress)
    return retrieval, reranked


def _online_rerank(dataset: Dataset, bank: Any, train_users: list[str], test_users: list[str],
                   cfg: PretrainConfig, progress: bool) -> dict[str, Any]:
    from rmm.training.online import OnlineConfig, OnlineTrainer, Split

    from rmm.eval.retrieval import GoldScorer, scorable
    from rmm.policy.learner import recipe_for

    recipe = recipe_for(cfg.rerank_recipe, bank.encoder.config.normalize)
    online = OnlineConfig(**recipe, epochs=cfg.rerank_epochs, seed=cfg.seed)
    trainer = OnlineTrainer(dataset, bank, online, progress=progress)
    questions = scorable(dataset.questions, GoldScorer.for_dataset(dataset, "turn"))
    train = [q for q in questions if q.user_id in set(train_users)]
    held = [q for q in questions if q.user_id in set(test_users)]
    # the pretraining split, not the online trainer's own: held-out conversations stay unseen by both
    trainer.split = Split(train, held, train_users, test_users,
                          f"pretraining split: reranker trains on {len(train)} questions, held out {len(held)}")
    report = trainer.run()
    return {"retriever_heldout": report.retriever_heldout, "reranker_heldout": report.reranker_heldout,
            "recipe": recipe["recipe"], "eval_k": online.eval_k}
