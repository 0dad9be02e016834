"""Training throughput (pairs/s): rmm's Lightning pretraining module vs sentence-transformers.

Same MiniLM model, same (question, gold turn) pairs in the same batches, same batch size, lr,
temperature (MNRL scale 20 = τ 0.05), max_length and step count, in one process. The
sentence-transformers side is SentenceTransformerTrainer + MultipleNegativesRankingLoss when the
`datasets` package is installed; otherwise the same loss driven by a plain torch loop over
`model.tokenize` (the trainer's own inner work, minus its bookkeeping), which is labelled so.

    python scripts/bench_pretrain.py --steps 10 [--data-dir DIR] [--batch-size 32] [--rounds 2]

Wall-clock from the end of a warm-up step to the end of the last step (tokenisation, data
loading and optimiser included) on each side; rounds alternate the two sides and
the best round of each is reported (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch


def _mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rates(batches: list[list[int]], marks: list[tuple[float, float]]) -> tuple[float, float]:
    """(pairs per wall second, pairs per CPU second of this process) after the warm-up step.

    CPU seconds are the steadier figure on a shared machine: other jobs stretch wall time."""
    pairs = sum(len(b) for b in batches[1:])
    return pairs / (marks[-1][0] - marks[0][0]), pairs / (marks[-1][1] - marks[0][1])


def rmm_round(cfg, batches: list[list[int]], dataset) -> tuple[float, float]:
    """Pairs/s of the Lightning module over `batches` (after one warm-up step)."""
    import lightning as L
    from rmm.training.pretrain import build

    module, data = build(cfg, dataset)
    module.train()

    class FixedBatches(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(batches)

        def __len__(self) -> int:
            return len(batches)

    data.train_dataloader = lambda: torch.utils.data.DataLoader(  # type: ignore[method-assign]
        list(range(len(data.pairs["train"]))), batch_sampler=FixedBatches(),
        collate_fn=lambda idx: data.collate("train", idx))
    data.val_dataloader = lambda: []  # type: ignore[method-assign]  # noqa: PIE807 (Lightning inspects __code__)
    marks: list[tuple[float, float]] = []

    class WallClock(L.Callback):  # from the end of the warm-up step to the end of the last one
        def on_train_batch_end(self, trainer, *_args) -> None:
            marks.append(_mark())

    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, gradient_clip_val=cfg.grad_clip,
                        callbacks=[WallClock()])
    trainer.fit(module, datamodule=data)
    return _rates(batches, marks)


def st_round(model_path: str, pairs, batches: list[list[int]], cfg) -> tuple[tuple[float, float], str]:
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.losses import (
            MultipleNegativesRankingLoss,
        )
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(model_path, device="cpu")
    model.max_seq_length = cfg.max_length
    loss = MultipleNegativesRankingLoss(model, scale=1.0 / cfg.temperature)
    try:
        import datasets  # noqa: F401
    except ImportError:
        return _st_loop(model, loss, pairs, batches, cfg), "MNRL, plain torch loop (no `datasets` package)"
    return _st_trainer(model, loss, pairs, batches, cfg), "SentenceTransformerTrainer + MNRL"


def _st_loop(model, loss, pairs, batches, cfg) -> tuple[float, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    marks: list[tuple[float, float]] = []
    for batch in batches:
        tokenize = getattr(model, "preprocess", model.tokenize)  # `tokenize` is deprecated in sentence-transformers 6
        features = [tokenize([pairs[i].query for i in batch]), tokenize([pairs[i].passage for i in batch])]
        value = loss(features, None)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        marks.append(_mark())
    return _rates(batches, marks)


def _st_trainer(model, loss, pairs, batches, cfg) -> tuple[float, float]:
    from datasets import Dataset as HFDataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import TrainerCallback

    order = [i for batch in batches for i in batch]
    train = HFDataset.from_dict({"anchor": [pairs[i].query for i in order],
                                 "positive": [pairs[i].passage for i in order]})

    class Timer(TrainerCallback):  # from the end of the warm-up step to the end of the last one
        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(_mark())

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        args = SentenceTransformerTrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.batch_size, learning_rate=cfg.lr,
            max_steps=len(batches), warmup_ratio=0.0, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
            logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, dataloader_drop_last=False,
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss,
                                             callbacks=[timer])
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(train)  # same batches
        trainer.train()
    return _rates(batches, timer.marks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (plus one warm-up)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", default=None, help="benchmark data (default: $RMM_DATA_DIR)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rmm.training.pretrain import NoDuplicateBatchSampler, build_pairs, split_users
    from rmm.training.pretrain_config import PretrainConfig

    from rmm.data import load_dataset
    from rmm.encoders.presets import PRESETS, resolve_preset_path

    dataset = load_dataset("locomo", args.data_dir)
    model_path = str(resolve_preset_path(PRESETS["minilm"]))
    cfg = PretrainConfig(encoder=model_path, batch_size=args.batch_size, max_length=args.max_length,
                         checkpoint=False, progress=False, accelerator="cpu", devices=1, precision="32-true",
                         lr=1e-4, temperature=0.05, eval_before=False)
    split = split_users([u for u in dataset.users if dataset.questions_of(u)], cfg.val_fraction, cfg.test_fraction,
                        cfg.seed)
    pairs = build_pairs(dataset, split.train)
    batches = [b for b in NoDuplicateBatchSampler(pairs, args.batch_size, seed=0) if len(b) == args.batch_size]
    batches = batches[: args.steps + 1]
    print(f"MiniLM-L6, {len(batches) - 1} timed steps of {args.batch_size} LoCoMo (question, gold turn) pairs, "
          f"max_length {args.max_length}, {torch.get_num_threads()} threads")
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    label = ""
    for round_ in range(args.rounds):
        ours.append(rmm_round(cfg, batches, dataset))
        rate, label = st_round(model_path, pairs, batches, cfg)
        theirs.append(rate)
        print(f"round {round_ + 1}: rmm {ours[-1][0]:.2f} pairs/s wall ({ours[-1][1]:.2f} per CPU-s), "
              f"sentence-transformers {theirs[-1][0]:.2f} pairs/s wall ({theirs[-1][1]:.2f} per CPU-s)")
    for index, unit in ((0, "pairs/s (wall)"), (1, "pairs per CPU-second")):
        best_ours, best_theirs = max(r[index] for r in ours), max(r[index] for r in theirs)
        print(f"{unit}: rmm Lightning module {best_ours:.2f}, sentence-transformers ({label}) {best_theirs:.2f}, "
              f"ratio {best_ours / best_theirs:.2f} (goal >= 1.0; best of {args.rounds})")

if __name__ == "__main__":
    main()
