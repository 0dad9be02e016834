"""Training throughput (pairs/s): rmm's Lightning pretraining module vs sentence-transformers.

Both sides train the same MiniLM-L6 folder on the same (question, gold turn) LoCoMo pairs in the
same batches (built once by rmm's no-duplicate sampler, full batches only), with the same batch
size, step count, max_length (128), fp32 precision, lr, weight decay, grad-norm clip 1.0 and
temperature (MNRL scale 20 = τ 0.05), in one process (same threads).

- rmm: `rmm.training.pretrain.build` + `make_trainer` — the module and Lightning trainer that
  `rmm pretrain` runs (checkpointing, progress bar and validation off; its logging kept).
- sentence-transformers (`--baseline trainer`, the default when `datasets` and `accelerate` are
  installed): `SentenceTransformerTrainer` + `MultipleNegativesRankingLoss(scale=20)` with its
  default optimiser (transformers' `adamw_torch_fused` on torch ≥ 2.8), no evaluation, no saving,
  no reporting, progress bar off, logging at its default (every 500 steps: never here), and a
  sequential batch sampler over the pairs laid out in our batch order (so it sees our batches).
  `--baseline loop` is the same loss and model in a plain torch loop (tokenise, forward, backward,
  clip, AdamW), for machines without `datasets`; `auto` falls back to it and says so.

Timing on each side runs from the end of a warm-up step to the end of the last step (data
loading, tokenisation, forward, backward, clipping and optimiser included; model loading not).
The machine may be shared: rounds alternate the order of the two sides (rmm first in odd rounds,
sentence-transformers first in even ones) and the summary reports medians over rounds, and the
median of the per-round ratios, in wall pairs/s and in pairs per CPU-second of this process.

    python scripts/bench_pretrain.py [--steps 10] [--rounds 3] [--baseline auto|trainer|loop]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch

Rate = tuple[float, float]  # (pairs per wall second, pairs per CPU second)


def _mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rates(batches: list[list[int]], marks: list[tuple[float, float]]) -> Rate:
    """(pairs per wall second, pairs per CPU second of this process) after the warm-up step.

    CPU seconds are the steadier figure on a shared machine: other jobs stretch wall time."""
    if len(marks) != len(batches):
        raise RuntimeError(f"timed {len(marks)} steps, expected {len(batches)}")
    pairs = sum(len(b) for b in batches[1:])
    return pairs / (marks[-1][0] - marks[0][0]), pairs / (marks[-1][1] - marks[0][1])


def rmm_round(cfg, batches: list[list[int]], dataset) -> Rate:
    """Pairs/s of the Lightning module, with the trainer `rmm pretrain` builds, over `batches`."""
    import lightning as L
    from rmm.training.pretrain import build, make_trainer

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

    class WallClock(L.Callback):  # after each optimiser step
        def on_train_batch_end(self, trainer, *_args) -> None:
            marks.append(_mark())

    make_trainer(cfg, [WallClock()]).fit(module, datamodule=data)
    return _rates(batches, marks)


def _st_model_and_loss(model_path: str, cfg):
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.losses import (
            MultipleNegativesRankingLoss,
        )
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(model_path, device="cpu")
    model.max_seq_length = cfg.max_length
    return model, MultipleNegativesRankingLoss(model, scale=1.0 / cfg.temperature)


def trainer_available() -> str | None:
    """None when SentenceTransformerTrainer can run here, else what is missing."""
    missing = []
    for package in ("datasets", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    return " and ".join(f"`{m}`" for m in missing) or None


def st_loop_round(model_path: str, pairs, batches: list[list[int]], cfg) -> Rate:
    """MNRL in a plain torch loop: the trainer's inner work without its bookkeeping."""
    model, loss = _st_model_and_loss(model_path, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    model.train()
    marks: list[tuple[float, float]] = []
    tokenize = getattr(model, "preprocess", model.tokenize)  # `tokenize` is deprecated in sentence-transformers 6
    for batch in batches:
        features = [tokenize([pairs[i].query for i in batch]), tokenize([pairs[i].passage for i in batch])]
        value = loss(features, None)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        marks.append(_mark())
    return _rates(batches, marks)


def st_trainer_round(model_path: str, pairs, batches: list[list[int]], cfg) -> Rate:
    """SentenceTransformerTrainer + MNRL with a user's sensible settings (see the module docstring)."""
    from datasets import Dataset as HFDataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from transformers import TrainerCallback

    model, loss = _st_model_and_loss(model_path, cfg)
    order = [i for batch in batches for i in batch]  # every batch is full: sequential batches = ours
    train = HFDataset.from_dict({"anchor": [pairs[i].query for i in order],
                                 "positive": [pairs[i].passage for i in order]})

    def our_batches(dataset, batch_size: int, drop_last: bool, **_kwargs) -> DefaultBatchSampler:
        return DefaultBatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=batch_size,
                                   drop_last=drop_last)

    marks: list[tuple[float, float]] = []

    class WallClock(TrainerCallback):  # after each optimiser step
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(_mark())

    with tempfile.TemporaryDirectory() as out:
        args = SentenceTransformerTrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.batch_size, max_steps=len(batches),
            learning_rate=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
            eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
            batch_sampler=our_batches, seed=cfg.seed,
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss,
                                             callbacks=[WallClock()])
        trainer.train()
    return _rates(batches, marks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (plus one warm-up)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--baseline", choices=("auto", "trainer", "loop"), default="auto",
                        help="sentence-transformers side: its trainer (auto when `datasets` is installed) "
                             "or a plain loop")
    parser.add_argument("--data-dir", default=None, help="benchmark data (default: $RMM_DATA_DIR)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    missing = trainer_available()
    if args.baseline == "trainer" and missing:
        parser.error(f"--baseline trainer needs {missing}: pip install datasets accelerate")
    use_trainer = args.baseline == "trainer" or (args.baseline == "auto" and not missing)
    if use_trainer:
        label, st_round = "SentenceTransformerTrainer + MNRL", st_trainer_round
    else:
        why = f"{missing} not installed" if missing and args.baseline == "auto" else "--baseline loop"
        label, st_round = f"MNRL in a plain torch loop ({why})", st_loop_round

    from rmm.training.pretrain import NoDuplicateBatchSampler, build_pairs, split_users
    from rmm.training.pretrain_config import PretrainConfig

    from rmm.data import load_dataset
    from rmm.encoders.presets import PRESETS, resolve_preset_path

    dataset = load_dataset("locomo", args.data_dir)
    model_path = str(resolve_preset_path(PRESETS["minilm"]))
    cfg = PretrainConfig(encoder=model_path, batch_size=args.batch_size, max_length=args.max_length,
                         checkpoint=False, progress=False, accelerator="cpu", devices=1, precision="32-true",
                         lr=1e-4, temperature=0.05, eval_before=False, max_steps=args.steps + 1,
                         output_dir=tempfile.mkdtemp(prefix="bench-pretrain-"))
    split = split_users([u for u in dataset.users if dataset.questions_of(u)], cfg.val_fraction, cfg.test_fraction,
                        cfg.seed)
    pairs = build_pairs(dataset, split.train)
    batches = [b for b in NoDuplicateBatchSampler(pairs, args.batch_size, seed=0) if len(b) == args.batch_size]
    batches = batches[: args.steps + 1]
    if len(batches) < 2:
        parser.error("need at least 2 full batches (1 warm-up + 1 timed)")
    print(f"MiniLM-L6, {len(batches) - 1} timed steps (+1 warm-up) of {args.batch_size} LoCoMo (question, gold turn) "
          f"pairs, max_length {args.max_length}, fp32, {torch.get_num_threads()} threads; baseline: {label}",
          flush=True)
    ours: list[Rate] = []
    theirs: list[Rate] = []
    for round_ in range(args.rounds):
        if round_ % 2 == 0:
            ours.append(rmm_round(cfg, batches, dataset))
            theirs.append(st_round(model_path, pairs, batches, cfg))
        else:
            theirs.append(st_round(model_path, pairs, batches, cfg))
            ours.append(rmm_round(cfg, batches, dataset))
        print(f"round {round_ + 1} ({'rmm first' if round_ % 2 == 0 else 'sentence-transformers first'}): "
              f"rmm {ours[-1][0]:.2f} pairs/s wall ({ours[-1][1]:.2f} per CPU-s), sentence-transformers "
              f"{theirs[-1][0]:.2f} pairs/s wall ({theirs[-1][1]:.2f} per CPU-s), "
              f"ratio {ours[-1][0] / theirs[-1][0]:.2f} wall ({ours[-1][1] / theirs[-1][1]:.2f} CPU)", flush=True)
    for index, unit in ((0, "pairs/s (wall)"), (1, "pairs per CPU-second")):
        median_ours = statistics.median(r[index] for r in ours)
        median_theirs = statistics.median(r[index] for r in theirs)
        ratio = statistics.median(a[index] / b[index] for a, b in zip(ours, theirs))
        print(f"{unit}: rmm Lightning module {median_ours:.2f}, sentence-transformers ({label}) {median_theirs:.2f}; "
              f"median per-round ratio {ratio:.2f} (goal >= 1.0; {args.rounds} rounds)")


if __name__ == "__main__":
    main()
