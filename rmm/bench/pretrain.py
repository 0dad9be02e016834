"""Training throughput (pairs/s): rmm's Lightning pretraining module vs sentence-transformers.

Both sides train the same model folder (the bundled MiniLM-L6 unless --model or --random-weights)
on the same (question, gold turn) LoCoMo pairs in the same batches (built once by rmm's
no-duplicate sampler, full batches only), with the same batch size, step count, max_length (128),
precision (fp32 on CPU, bf16 autocast on CUDA), lr, weight decay, grad-norm clip 1.0, temperature
(MNRL scale 20 = τ 0.05) and hard negatives (`--hard-negatives N`: mined once with the base model,
the same N per pair on both sides), in one process (same threads, same device).

sentence-transformers (≥ 6) embeds the queries in one transformer pass and the positives with their
hard negatives in another; rmm's passes follow `merge_passes` (`--merge-passes`; auto: the same as
sentence-transformers on CUDA, a pass per text group on CPU).

`--device cuda` runs both on the GPU (timings synchronise the device). `--random-weights ARCH`
(contriever = BERT-base, minilm = MiniLM-L6) trains a randomly initialised model of that real
architecture, for machines where its weights cannot be carried; `--arch-override` shrinks it (tests).

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
On CUDA every side first runs its batches once untimed (`--warmup-rounds`): a kernel's first use of
a shape is costly there, and dynamic padding gives most batches a new shape. The machine may be
shared: each round starts with a different side, and the summary reports medians over rounds and
the median of the per-round ratios to sentence-transformers, in wall pairs/s and in pairs per
CPU-second of this process.

    python -m rmm.bench.pretrain [--steps 10] [--rounds 3] [--baseline auto|trainer|loop]
    python -m rmm.bench.pretrain --device cuda --random-weights contriever --hard-negatives 1 --steps 30
    python -m rmm.bench.pretrain ... --merge-passes candidates all   # two rmm sides, one baseline
    python -m rmm.bench.pretrain --random-weights contriever --hard-negatives 1 --count-ops
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from rmm.training.pretrain_config import MERGE_PASSES

Rate = tuple[float, float]  # (pairs per wall second, pairs per CPU second)
TARGET_PAIRS_PER_S = 1000  # issue 38's pretraining target on one GPU (with >= 1.0x the baseline)


def _mark() -> tuple[float, float]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # a step's kernels are finished before its time is taken
    return time.perf_counter(), time.process_time()


def _rates(batches: list[list[int]], marks: list[tuple[float, float]]) -> Rate:
    """(pairs per wall second, pairs per CPU second of this process) after the warm-up step.

    CPU seconds are the steadier figure on a shared machine: other jobs stretch wall time."""
    if len(marks) != len(batches):
        raise RuntimeError(f"timed {len(marks)} steps, expected {len(batches)}")
    pairs = sum(len(b) for b in batches[1:])
    return pairs / (marks[-1][0] - marks[0][0]), pairs / (marks[-1][1] - marks[0][1])


def rmm_round(cfg, batches: list[list[int]], dataset, negatives: dict[int, list[str]],
              built: dict | None = None, profile_rows: int = 0) -> Rate:
    """Pairs/s of the Lightning module, with the trainer `rmm pretrain` builds, over `batches`.

    `built` keeps the module and data of this side between rounds. CUDA graphs belong to one fit
    (Lightning moves the weights off the GPU after it), so a `cuda_graphs` side runs its batches
    twice in each fit and times the second pass: the captures are a cost per run of `rmm
    pretrain`, not per step. `profile_rows` > 0 runs the round under the torch profiler and prints
    that many of its top operations by host time and by GPU time."""
    import lightning as L
    from rmm.training.pretrain import build, make_trainer

    if built is not None and "module" in built:
        module, data = built["module"], built["data"]
    else:
        module, data = build(cfg, dataset)
        data.hard_negatives = negatives
        data.pretokenize()  # as `setup` does in `rmm pretrain`
        if built is not None:
            built.update(module=module, data=data)
    module.train()

    passes = 2 if cfg.cuda_graphs else 1
    cfg = dataclasses.replace(cfg, max_steps=passes * len(batches))

    class FixedBatches(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(batches * passes)

        def __len__(self) -> int:
            return len(batches) * passes

    data.train_dataloader = lambda: torch.utils.data.DataLoader(  # type: ignore[method-assign]
        list(range(len(data.pairs["train"]))), batch_sampler=FixedBatches(),
        collate_fn=lambda idx: data.collate("train", idx))
    data.val_dataloader = lambda: []  # type: ignore[method-assign]  # noqa: PIE807 (Lightning inspects __code__)
    marks: list[tuple[float, float]] = []

    class WallClock(L.Callback):  # after each optimiser step
        def on_train_batch_end(self, trainer, *_args) -> None:
            marks.append(_mark())

        def on_train_end(self, trainer, pl_module) -> None:  # before teardown drops the graphs
            if pl_module.graphed is not None and built is not None:
                built["note"] = f"{pl_module.graphed.captured} CUDA graphs captured in a fit"

    if profile_rows:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            make_trainer(cfg, [WallClock()]).fit(module, datamodule=data)
        table = prof.key_averages()
        print(f"profile, {len(batches)} steps (profiler on, so slower than the timed rounds); by host time:")
        print(table.table(sort_by="self_cpu_time_total", row_limit=profile_rows))
        if torch.cuda.is_available():
            print("by GPU time:")
            print(table.table(sort_by="self_device_time_total", row_limit=profile_rows))
    else:
        make_trainer(cfg, [WallClock()]).fit(module, datamodule=data)
    return _rates(batches, marks[-len(batches):])


def _st_model_and_loss(model_path: str, cfg, device: str):
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.losses import (
            MultipleNegativesRankingLoss,
        )
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(model_path, device=device)
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


def _columns(pairs, negatives: dict[int, list[str]], indices: list[int]) -> list[list[str]]:
    """anchor, positive, then one column per hard negative (MNRL's layout)."""
    count = min((len(negatives.get(i, [])) for i in indices), default=0)
    return ([[pairs[i].query for i in indices], [pairs[i].passage for i in indices]]
            + [[negatives[i][n] for i in indices] for n in range(count)])


def st_loop_round(model_path: str, pairs, batches: list[list[int]], cfg, device: str,
                  negatives: dict[int, list[str]]) -> Rate:
    """MNRL in a plain torch loop: the trainer's inner work without its bookkeeping."""
    model, loss = _st_model_and_loss(model_path, cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    model.train()
    marks: list[tuple[float, float]] = []
    tokenize = getattr(model, "preprocess", model.tokenize)  # `tokenize` is deprecated in sentence-transformers 6
    bf16 = device.startswith("cuda") and cfg.precision.startswith("bf16")
    for batch in batches:
        features = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tokenize(column).items()}
                    for column in _columns(pairs, negatives, batch)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            value = loss(features, None)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        marks.append(_mark())
    return _rates(batches, marks)


def st_trainer_round(model_path: str, pairs, batches: list[list[int]], cfg, device: str,
                     negatives: dict[int, list[str]]) -> Rate:
    """SentenceTransformerTrainer + MNRL with a user's sensible settings (see the module docstring)."""
    from datasets import Dataset as HFDataset
    from datasets.table import InMemoryTable
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from transformers import TrainerCallback

    model, loss = _st_model_and_loss(model_path, cfg, device)
    order = [i for batch in batches for i in batch]  # every batch is full: sequential batches = ours
    columns = _columns(pairs, negatives, order)
    names = ["anchor", "positive"] + [f"negative_{n + 1}" for n in range(len(columns) - 2)]
    # a fixed fingerprint: `from_dict` would hash the arrow table with dill, which fails on some
    # pyarrow releases (26: "Can't pickle MonthDayNano"); nothing here is cached, so none is needed
    train = HFDataset(InMemoryTable.from_pydict(dict(zip(names, columns))), fingerprint="rmm-bench-pretrain")

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
            eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=not device.startswith("cuda"), bf16=device.startswith("cuda") and cfg.precision.startswith("bf16"),
            batch_sampler=our_batches, seed=cfg.seed,
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss,
                                             callbacks=[WallClock()])
        trainer.train()
    return _rates(batches, marks)


class _DispatchCount(TorchDispatchMode):
    """Backend operations dispatched (views and allocations aside): on a GPU, about one kernel
    launch each — what bounds a step whose kernels are small."""

    FREE = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "slice", "select",
            "alias", "as_strided", "detach", "reshape", "_reshape_alias", "split", "split_with_sizes", "unbind",
            "lift_fresh", "empty", "empty_like", "empty_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ not in self.FREE
        return func(*args, **(kwargs or {}))


def _step_ops(parameters: list[torch.nn.Parameter], loss_fn) -> int:
    """Operations of one training step (loss, backward, norm clipping, fused AdamW), after one
    untimed step so that lazily built optimiser state is not counted."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=True)

    def step() -> None:
        loss = loss_fn()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], 1.0, foreach=True)
        optimizer.step()

    step()
    with _DispatchCount() as counter:
        step()
    return counter.count


def count_ops(cfg, dataset, negatives: dict[int, list[str]], indices: list[int], model_path: str, pairs,
              device: str, with_st: bool) -> None:
    """Print the operations one step dispatches: rmm under each `merge_passes`, and sentence-transformers."""
    from rmm.training.pretrain import build

    module, data = build(cfg, dataset)
    module.train()
    data.hard_negatives = negatives
    data.pretokenize()
    parameters = [p for p in module.parameters() if p.requires_grad]
    for merge in MERGE_PASSES[1:]:
        data.cfg = dataclasses.replace(cfg, merge_passes=merge)
        batch = data.collate("train", indices)
        batch["passes"] = [{k: v.to(device) for k, v in inputs.items()} for inputs in batch["passes"]]
        ops = _step_ops(parameters, lambda: module.batch_loss(batch))
        print(f"rmm, merge_passes {merge} ({len(batch['passes'])} transformer passes): {ops} operations a step")
    if with_st:
        model, loss = _st_model_and_loss(model_path, cfg, device)
        model.train()
        tokenize = getattr(model, "preprocess", model.tokenize)
        features = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tokenize(column).items()}
                    for column in _columns(pairs, negatives, indices)]
        ops = _step_ops([p for p in model.parameters() if p.requires_grad], lambda: loss(features, None))
        print(f"sentence-transformers, MultipleNegativesRankingLoss: {ops} operations a step")


def _model_folder(args: argparse.Namespace, parser: argparse.ArgumentParser, scratch: str) -> tuple[str, str]:
    """(model folder, what it is): --model, a random-weight architecture, or the bundled MiniLM."""
    if args.random_weights:
        from rmm.encoders.random_weights import architecture, write_random_encoder
        from rmm.errors import RmmError

        overrides = {}
        for item in args.arch_override:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"--arch-override expects KEY=VALUE, got {item!r}")
            overrides[key] = yaml.safe_load(value)
        try:
            folder = write_random_encoder(args.random_weights, os.path.join(scratch, "model"), **overrides)
            return str(folder), f"random-weight {architecture(args.random_weights).description}" + (
                f" with {overrides}" if overrides else "")
        except (RmmError, ValueError, TypeError) as err:  # unknown architecture, or overrides BertConfig refuses
            parser.error(f"--random-weights {args.random_weights}: {err}")
    if args.model:
        return args.model, args.model
    from rmm.encoders.presets import PRESETS, resolve_preset_path

    return str(resolve_preset_path(PRESETS["minilm"])), "MiniLM-L6"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (plus one warm-up)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--baseline", choices=("auto", "trainer", "loop"), default="auto",
                        help="sentence-transformers side: its trainer (auto when `datasets` is installed) "
                             "or a plain loop")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("auto", "32-true", "bf16-mixed"), default="auto",
                        help="auto: bf16 autocast on CUDA, fp32 on CPU (both sides)")
    parser.add_argument("--hard-negatives", type=int, default=0, help="hard negatives per pair (both sides)")
    parser.add_argument("--model", default=None, help="model folder (default: the bundled MiniLM)")
    parser.add_argument("--random-weights", metavar="ARCH", default=None,
                        help="random weights of this architecture instead: contriever (BERT-base) or minilm")
    parser.add_argument("--arch-override", metavar="KEY=VALUE", nargs="*", default=[],
                        help="BertConfig fields for --random-weights (e.g. hidden_size=32)")
    parser.add_argument("--merge-passes", choices=MERGE_PASSES, nargs="+", default=["auto"],
                        help="rmm sides: which texts share a transformer pass (PretrainConfig.merge_passes); "
                             "several values time one rmm side each against the same baseline")
    parser.add_argument("--cuda-graphs", choices=("off", "on"), nargs="+", default=["off"],
                        help="rmm sides with and/or without CUDA graphs (PretrainConfig.cuda_graphs; --device cuda); "
                             "each value times one rmm side per --merge-passes value")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after the timed rounds, one more round under the torch profiler of each rmm side that "
                             f"misses a target (median below {TARGET_PAIRS_PER_S:,} pairs/s or below the baseline): "
                             "print its top ROWS operations by host and by GPU time")
    parser.add_argument("--warmup-rounds", type=int, default=None,
                        help="untimed rounds of every side first (default: 1 on CUDA, where a kernel's first "
                             "use of a shape is costly, 0 on CPU)")
    parser.add_argument("--count-ops", action="store_true",
                        help="print the operations one step dispatches (about one GPU kernel launch each) for "
                             "rmm's pass layouts and sentence-transformers, then exit (no timing)")
    parser.add_argument("--data-dir", default=None, help="benchmark data (default: $RMM_DATA_DIR)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.random_weights and args.model:
        parser.error("--model and --random-weights are alternatives")
    if "on" in args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs on needs --device cuda")
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

    from rmm.training.pretrain import NoDuplicateBatchSampler, build_pairs, mine_hard_negatives, split_users
    from rmm.training.pretrain.module import resolve_merge_passes
    from rmm.training.pretrain_config import PretrainConfig

    from rmm.data import load_dataset
    from rmm.encoders import load_encoder

    scratch = tempfile.mkdtemp(prefix="bench-pretrain-")
    model_path, model_label = _model_folder(args, parser, scratch)
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if args.device == "cuda" else "32-true")
    dataset = load_dataset("locomo", args.data_dir)
    cfg = PretrainConfig(encoder=model_path, batch_size=args.batch_size, max_length=args.max_length,
                         checkpoint=False, progress=False, accelerator="gpu" if args.device == "cuda" else "cpu",
                         devices=1, precision=precision, lr=1e-4, temperature=0.05, eval_before=False,
                         hard_negatives=args.hard_negatives, refresh_hard_negatives=False,
                         max_steps=args.steps + 1, output_dir=os.path.join(scratch, "out"))
    split = split_users([u for u in dataset.users if dataset.questions_of(u)], cfg.val_fraction, cfg.test_fraction,
                        cfg.seed)
    pairs = build_pairs(dataset, split.train)
    negatives: dict[int, list[str]] = {}
    if args.hard_negatives:
        miner = load_encoder(model_path, device=args.device, max_length=args.max_length)
        negatives = mine_hard_negatives(miner, dataset, pairs, args.hard_negatives)
        del miner
    batches = [b for b in NoDuplicateBatchSampler(pairs, args.batch_size, seed=0, hard_negatives=negatives)
               if len(b) == args.batch_size]
    batches = batches[: args.steps + 1]
    if len(batches) < 2:
        parser.error("need at least 2 full batches (1 warm-up + 1 timed)")
    if args.count_ops:
        with_st = importlib.util.find_spec("sentence_transformers") is not None
        count_ops(cfg, dataset, negatives, batches[0], model_path, pairs, args.device, with_st)
        shutil.rmtree(scratch, ignore_errors=True)
        return
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    layouts = list(dict.fromkeys(resolve_merge_passes(dataclasses.replace(cfg, merge_passes=m))
                                 for m in args.merge_passes))
    warmups = args.warmup_rounds if args.warmup_rounds is not None else int(args.device == "cuda")
    graphs = list(dict.fromkeys(g == "on" for g in args.cuda_graphs))
    print(f"{model_label}, {len(batches) - 1} timed steps (+1 warm-up) of {args.batch_size} LoCoMo (question, gold "
          f"turn) pairs + {args.hard_negatives} hard negative(s), max_length {args.max_length}, {precision}, "
          f"{device_name}; rmm: merge_passes {', '.join(layouts)}, CUDA graphs {', '.join(args.cuda_graphs)}; "
          f"baseline: {label}; {warmups} untimed warm-up round(s)", flush=True)
    st_name = "sentence-transformers"
    rmm_sides = {(f"rmm ({m}{', graphs' if g else ''})"): dataclasses.replace(cfg, merge_passes=m, cuda_graphs=g)
                 for m in layouts for g in graphs}
    built: dict[str, dict] = {name: {} for name in rmm_sides}  # each rmm side's module, kept between rounds
    sides: dict[str, Callable[[], Rate]] = {
        **{name: functools.partial(rmm_round, side_cfg, batches, dataset, negatives, built[name])
           for name, side_cfg in rmm_sides.items()},
        st_name: functools.partial(st_round, model_path, pairs, batches, cfg, args.device, negatives),
    }
    failed: dict[str, str] = {}

    def run_side(name: str) -> Rate | None:
        """A round of one side; an rmm side that raises is reported and dropped, the others still timed
        (the baseline's failure ends the benchmark)."""
        if name == st_name:
            return sides[name]()
        try:
            return sides[name]()
        except Exception as err:  # noqa: BLE001 - any failure of one side (a capture, a kernel) is its result
            import traceback

            failed[name] = f"{type(err).__name__}: {err}"
            print(f"{name} failed and is dropped: {failed[name]}\n{traceback.format_exc(limit=-6)}", flush=True)
            return None

    for _ in range(warmups):  # every shape each side will see, once: first-use costs are not throughput
        for name in sides:
            if name not in failed:
                run_side(name)
    rates: dict[str, list[Rate]] = {name: [] for name in sides}
    names = [name for name in sides if name not in failed]
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]  # each side first in turn
        for name in order:
            if (rate := run_side(name)) is not None:
                rates[name].append(rate)
        names = [name for name in names if name not in failed]
        figures = ", ".join(f"{name} {rates[name][-1][0]:.2f} pairs/s wall ({rates[name][-1][1]:.2f} per CPU-s)"
                            for name in names)
        ratios = ", ".join(f"{name} / {st_name} {rates[name][-1][0] / rates[st_name][-1][0]:.2f} wall "
                           f"({rates[name][-1][1] / rates[st_name][-1][1]:.2f} CPU)" for name in names[:-1])
        print(f"round {round_ + 1} ({order[0]} first): {figures}; {ratios}", flush=True)
    for index, unit in ((0, "pairs/s (wall)"), (1, "pairs per CPU-second")):
        medians = ", ".join(f"{name} {statistics.median(r[index] for r in rates[name]):.2f}" for name in names)
        ratios = ", ".join(
            f"{name} {statistics.median(a[index] / b[index] for a, b in zip(rates[name], rates[st_name])):.2f}"
            for name in names[:-1])
        print(f"{unit}: {medians} ({label}); median per-round ratio to sentence-transformers: {ratios} "
              f"(goal >= 1.0; {args.rounds} rounds)")
    for name in rmm_sides:
        if "note" in built[name]:
            print(f"{name}: {built[name]['note']}")
        if name in failed:
            print(f"{name}: failed ({failed[name]})")
    for name, side_cfg in rmm_sides.items():
        if not args.profile or name in failed:
            continue
        wall = statistics.median(r[0] for r in rates[name])
        if wall >= TARGET_PAIRS_PER_S and wall >= statistics.median(r[0] for r in rates[st_name]):
            print(f"== {name}: meets the targets, not profiled")
            continue
        print(f"== {name}", flush=True)
        try:
            rmm_round(side_cfg, batches, dataset, negatives, built[name], profile_rows=args.profile)
        except RuntimeError as err:  # the profiler is an extra: its failure leaves the figures above standing
            print(f"profile of {name} failed: {err}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
