"""Offline contrastive pretraining: pairs, split, sampler, loss/gather maths, a tiny real run, config."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("lightning")

from rmm.training.pretrain import (
    NoDuplicateBatchSampler,
    Pair,
    build,
    build_pairs,
    contrastive_logits,
    contrastive_loss,
    make_trainer,
    mine_hard_negatives,
    run_pretrain,
    split_users,
)
from rmm.training.pretrain.module import _fused_adamw_supported, resolve_merge_passes
from rmm.cli.pretrain import register as register_pretrain
from rmm.training.pretrain_config import (
    PretrainConfig,
    PretrainConfigError,
    load_config,
)

from rmm.data import load_dataset
from rmm.encoders import load_encoder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_encoder_dir(tmp_path: Path, minilm_path: Path) -> Path:
    """A 1-layer random BERT with MiniLM's tokenizer, saved as an rmm encoder folder (fast to train)."""
    from transformers import BertConfig, BertModel

    folder = tmp_path / "tiny-bert"
    torch.manual_seed(0)
    tokenizer_files = ["vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    folder.mkdir()
    for name in tokenizer_files:
        if (minilm_path / name).is_file():
            shutil.copy(minilm_path / name, folder / name)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(folder)
    (folder / "rmm_encoder.json").write_text(json.dumps({"format": 1, "name": "tiny", "pooling": "mean",
                                                         "normalize": True, "dense": False, "max_length": 64}))
    return folder


def tiny_config(tmp_path: Path, data_dir: Path, encoder: Path | str, **overrides) -> PretrainConfig:
    base: dict = {"encoder": str(encoder), "data_dir": str(data_dir), "output_dir": str(tmp_path / "out"),
                  "epochs": 1, "batch_size": 4, "lr": 1e-3, "max_length": 32, "accelerator": "cpu", "devices": 1,
                  "precision": "32-true", "checkpoint": False, "progress": False, "val_fraction": 0.0,
                  "test_fraction": 0.34, "eval_ks": [5]}
    base.update(overrides)
    return PretrainConfig(**base)


def pair(query: str, passage: str, gold: tuple[str, ...] = (), user: str = "u") -> Pair:
    return Pair(query, passage, user, query, passage, frozenset(gold or (passage,)))


# ------------------------------------------------------------------------------------- data


def test_pairs_use_bank_turn_text_and_split_is_disjoint(tiny_data_dir: Path) -> None:
    dataset = load_dataset("locomo", tiny_data_dir)
    split = split_users(dataset.users, 0.34, 0.34, seed=3)
    assert set(split.train) | set(split.val) | set(split.test) == set(dataset.users)
    assert not set(split.train) & set(split.test) and not set(split.val) & set(split.test)
    assert not set(split.train) & set(split.val)
    assert split_users(dataset.users, 0.34, 0.34, seed=3) == split  # seeded
    pairs = build_pairs(dataset, split.train)
    assert pairs and {p.user for p in pairs} == set(split.train)
    # passages read exactly as the turn bank stores them: "speaker: text"
    assert all(p.passage.split(": ", 1)[0] in {"Ana", "Ben"} for p in pairs)
    with pytest.raises(Exception, match="2 users"):
        split_users(["only"], 0.1, 0.3, 0)


def test_no_duplicate_sampler_never_batches_a_false_negative() -> None:
    pairs = []
    for i in range(40):
        # many questions share a passage, some questions repeat, one question has two gold turns
        pairs.append(pair(f"q{i % 13}", f"p{i % 7}", gold=(f"p{i % 7}", f"p{(i + 1) % 7}") if i % 5 == 0 else ()))
    negatives = {i: [f"p{(i + 3) % 7}"] for i in range(len(pairs))}
    sampler = NoDuplicateBatchSampler(pairs, batch_size=5, seed=1, hard_negatives=negatives)
    seen: list[int] = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        seen = []
        for batch in sampler:
            assert len(batch) <= 5
            passages = [pairs[i].passage for i in batch]
            assert len(passages) == len(set(passages))
            assert len({pairs[i].query for i in batch}) == len(batch)
            for i in batch:
                others_shown = {pairs[j].passage for j in batch if j != i} | {
                    n for j in batch if j != i for n in negatives[j]}
                assert not (pairs[i].gold_passages & others_shown)
            seen += batch
        assert sorted(seen) == list(range(len(pairs)))  # every pair once per epoch


def test_sampler_shards_equal_slices_across_ranks() -> None:
    pairs = [pair(f"q{i}", f"p{i}") for i in range(23)]
    shards = [list(NoDuplicateBatchSampler(pairs, 4, seed=0, num_replicas=2, rank=r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    for a, b in zip(*shards):
        assert len(a) == len(b) and not set(a) & set(b)


def test_hard_negatives_exclude_gold(tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    dataset = load_dataset("locomo", tiny_data_dir)
    pairs = build_pairs(dataset, dataset.users[:1])
    encoder = load_encoder(str(tiny_encoder_dir), device="cpu")
    mined = mine_hard_negatives(encoder, dataset, pairs, k=3)
    assert set(mined) == set(range(len(pairs)))
    for i, negatives in mined.items():
        assert len(negatives) == 3
        assert not set(negatives) & pairs[i].gold_passages
        user_turns = {f"{t.speaker}: {t.text}" for t in dataset.turns(pairs[i].user)}
        assert set(negatives) <= user_turns


# ------------------------------------------------------------------------------------- loss


def test_logits_columns_and_labels_follow_rank_offsets() -> None:
    q = torch.eye(3)[:2]  # 2 local queries
    positives_all = torch.eye(3)[[2, 2, 0, 1]]  # 2 ranks × 2 positives; rank 1 holds columns 2, 3
    negatives_all = torch.zeros(2, 3)
    logits, labels = contrastive_logits(q, positives_all, negatives_all, rank=1, scale=2.0)
    assert logits.shape == (2, 6)
    assert labels.tolist() == [2, 3]
    assert logits[0, 2] == 2.0 and logits[1, 3] == 2.0


def test_fake_world_gather_gives_the_global_batch_gradient() -> None:
    """W ranks, each computing its local mean loss against gathered passages whose backward sums
    the gradients (as the differentiable all_gather does), then DDP's mean over ranks, equals the
    single-process loss and gradient of the whole global batch."""
    torch.manual_seed(0)
    world, local, dim = 3, 4, 8
    q = torch.randn(world * local, dim, requires_grad=True)
    p = torch.randn(world * local, dim, requires_grad=True)
    n = torch.randn(world * local, dim, requires_grad=True)
    single = contrastive_loss(q, p, n, scale=20.0)  # no process group: world of one
    grads_single = torch.autograd.grad(single, [q, p, n])
    per_rank = []
    for rank in range(world):
        rows = slice(rank * local, (rank + 1) * local)
        logits, labels = contrastive_logits(q[rows], p, n, rank, 20.0)  # p, n: "gathered" (grad flows to all)
        per_rank.append(torch.nn.functional.cross_entropy(logits, labels))
    ddp = torch.stack(per_rank).mean()  # DDP averages gradients over ranks
    grads_ddp = torch.autograd.grad(ddp, [q, p, n])
    assert torch.allclose(single, ddp, atol=1e-6)
    for a, b in zip(grads_single, grads_ddp):
        assert torch.allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------------------------- training


def test_loss_decreases_on_a_fixed_batch(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir)
    module, data = build(cfg)
    module.train()
    batch = data.collate("train", list(range(4)))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        loss = module.batch_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path: Path, tiny_data_dir: Path,
                                                         tiny_encoder_dir: Path) -> None:
    grads = []
    for checkpointing in (False, True):
        module, data = build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir,
                                         gradient_checkpointing=checkpointing))
        module.eval()  # no dropout: the two passes must agree exactly
        module.batch_loss(data.collate("train", [0, 1, 2])).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def _loss_and_gradients(module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    module.zero_grad()
    loss = module.batch_loss(batch)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None])


@pytest.mark.parametrize(("merge", "passes"), [("candidates", 2), ("all", 1)])
def test_merged_passes_give_the_loss_of_one_pass_per_text_group(tmp_path: Path, tiny_data_dir: Path,
                                                                 tiny_encoder_dir: Path, merge: str, passes: int) -> None:
    """Texts sharing a transformer pass (merge_passes) are padded to a longer text: that must not
    change any embedding, so loss and gradients equal a pass per text group."""
    module, data = build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, hard_negatives=2,
                                     merge_passes=merge))
    module.eval()  # no dropout: the passes must agree to float error
    data.setup("fit")
    data.mine()
    indices = [0, 1, 2, 3]
    batch = data.collate("train", indices)
    assert len(batch["passes"]) == passes and batch["counts"] == (4, 4, 8)
    loss, gradients = _loss_and_gradients(module, batch)

    data.cfg = dataclasses.replace(data.cfg, merge_passes="none")
    separate = data.collate("train", indices)
    assert len(separate["passes"]) == 3 and separate["counts"] == (4, 4, 8)
    want_loss, want_gradients = _loss_and_gradients(module, separate)
    assert torch.allclose(loss, want_loss, atol=1e-5)
    assert torch.allclose(gradients, want_gradients, atol=1e-5)


def test_merge_passes_auto_follows_where_training_runs() -> None:
    """auto: a pass per text group on CPU (padding costs arithmetic), candidates merged on CUDA."""
    cpu = PretrainConfig(accelerator="cpu")
    assert resolve_merge_passes(cpu) == "none"
    assert resolve_merge_passes(dataclasses.replace(cpu, merge_passes="all")) == "all"
    gpu = resolve_merge_passes(PretrainConfig(accelerator="gpu"))
    assert gpu == ("candidates" if torch.cuda.is_available() else "none")
    with pytest.raises(PretrainConfigError, match="merge_passes must be one of auto, none, candidates, all"):
        PretrainConfig(merge_passes="queries")


def test_trained_module_exports_an_encoder_that_loads_with_the_same_embeddings(
        tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, max_steps=3, hard_negatives=1)
    module, data = build(cfg)
    module.train()
    trainer = make_trainer(cfg)
    trainer.fit(module, datamodule=data)
    assert trainer.optimizers[0].defaults["fused"] is True  # CPU fp32: AdamW's fused kernel
    module.eval()
    saved = module.export_encoder(tmp_path / "encoder")
    loaded = load_encoder(str(saved), device="cpu")
    assert loaded.config.pooling == "mean" and loaded.config.normalize and loaded.dim == 32
    texts = ["Ana: I went hiking in the Alps", "What novel are they reading?"]
    trained = module.encoder.encode_passages(texts)
    assert torch.allclose(loaded.encode_passages(texts), trained, atol=1e-5)
    base = load_encoder(str(tiny_encoder_dir), device="cpu")
    assert not torch.allclose(base.encode_passages(texts), trained, atol=1e-4)  # training moved the weights
    assert data.hard_negatives and all(len(n) == 1 for n in data.hard_negatives.values())


def test_run_pretrain_reports_heldout_recall_before_and_after(
        tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, max_steps=2)
    report = run_pretrain(cfg)
    assert report.steps == 2 and report.pairs_per_second > 0
    assert report.before["n"] == report.after["n"] > 0 and "recall@5" in report.after
    assert "test 1" in report.split
    assert load_encoder(report.output, device="cpu").dim == 32
    assert json.loads((Path(cfg.output_dir) / "report.json").read_text())["steps"] == 2


def test_only_heads_embed_never_reads_are_frozen(tmp_path: Path, tiny_data_dir: Path,
                                                  tiny_encoder_dir: Path) -> None:
    """BERT's pooler gets no gradient from the loss (embed pools last_hidden_state): trainable, it
    would make DDP fail; every other weight must stay trainable."""
    module, _ = build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir))
    frozen = {name for name, p in module.model.named_parameters() if not p.requires_grad}
    assert frozen == {"pooler.dense.weight", "pooler.dense.bias"}


def test_fused_adamw_is_skipped_where_lightning_or_torch_cannot_use_it() -> None:
    cpu = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert _fused_adamw_supported(cpu, "32-true") and _fused_adamw_supported(cpu, "bf16-mixed")
    assert not _fused_adamw_supported(cpu, "16-mixed")  # GradScaler + clipping: Lightning refuses
    assert not _fused_adamw_supported([torch.nn.Parameter(torch.zeros(2, 2, device="meta"))], "32-true")
    assert not _fused_adamw_supported([], "32-true")


def test_gradient_clipping_caps_the_global_norm(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    module, data = build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, grad_clip=0.5))
    module.batch_loss(data.collate("train", [0, 1, 2])).backward()
    parameters = [p for p in module.parameters() if p.grad is not None]
    for p in parameters:
        p.grad.mul_(100.0)  # well above the cap
    optimizer = torch.optim.AdamW(parameters)
    module.configure_gradient_clipping(optimizer, 0.5, "norm")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in parameters]))
    assert norm.item() == pytest.approx(0.5, rel=1e-4)


def test_ddp_trains_on_our_sampler_batches_not_lightnings(tmp_path: Path, tiny_data_dir: Path,
                                                          tiny_encoder_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a distributed strategy Lightning swaps in its DistributedSampler (and refuses to, for a
    batch sampler like ours); a one-process gloo DDP run must train on exactly the batches
    NoDuplicateBatchSampler yields, in its order."""
    import lightning as L
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, strategy="ddp", max_steps=2)
    module, data = build(cfg)
    module.train()
    seen: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
            seen.append(args[1]["passes"][0]["input_ids"].cpu())  # the queries' pass

    environ = dict(os.environ)  # Lightning's DDP setup writes the rank/port variables
    try:
        make_trainer(cfg, [Record()]).fit(module, datamodule=data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    sampler = NoDuplicateBatchSampler(data.pairs["train"], cfg.batch_size, seed=cfg.seed)
    expected = [data.collate("train", indices)["passes"][0]["input_ids"] for indices in list(sampler)[:2]]
    assert len(seen) == 2
    for got, want in zip(seen, expected):
        assert torch.equal(got, want)


def test_lora_without_peft_says_how_to_install(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(Exception, match="pip install peft"):
        build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, lora=True))


# ------------------------------------------------------------------------------------- config


def test_config_overrides_parse_and_bad_keys_are_refused(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "pretrain" / "minilm-locomo-cpu.yaml",
                      ["epochs=3", "lr=2e-5", "lora_target_modules=[q_proj, v_proj]", "learnable_temperature=true"])
    assert cfg.epochs == 3 and cfg.lr == 2e-5 and cfg.learnable_temperature is True
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.batch_size == 32
    with pytest.raises(PretrainConfigError, match="did you mean epochs"):
        load_config(None, ["epoch=3"])
    with pytest.raises(PretrainConfigError, match="key=value"):
        load_config(None, ["epochs"])
    with pytest.raises(PretrainConfigError, match="batch_size"):
        load_config(None, ["batch_size=0"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("encoder: minilm\nlearning_rate: 0.1\n")
    with pytest.raises(PretrainConfigError, match="learning_rate"):
        load_config(bad)
    with pytest.raises(PretrainConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("recipe", sorted((REPO / "configs" / "pretrain").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_loads_and_overrides_win(recipe: Path, tmp_path: Path) -> None:
    """Each recipe's every key reaches the config (typed), a key=value override changes only its
    field, and the same recipe with a typo'd key is refused naming the key and the file."""
    written = yaml.safe_load(recipe.read_text())
    cfg = load_config(recipe)
    for key, value in written.items():
        loaded = getattr(cfg, key)
        assert loaded == (float(value) if isinstance(loaded, float) else value), key
    overridden = load_config(recipe, [f"epochs={cfg.epochs + 1}", f"output_dir={tmp_path}"])
    assert overridden.epochs == cfg.epochs + 1 and overridden.output_dir == str(tmp_path)
    assert {**overridden.to_dict(), "epochs": cfg.epochs, "output_dir": cfg.output_dir} == cfg.to_dict()
    typo = tmp_path / "typo.yaml"
    typo.write_text(recipe.read_text() + "\nhard_negative: 4\n")
    with pytest.raises(PretrainConfigError, match=rf"\['hard_negative'\] in {typo}.*did you mean hard_negatives"):
        load_config(typo)


def test_cli_command_registers_and_parses_overrides() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register_pretrain(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["pretrain", "--config", "x.yaml", "epochs=2", "lora=true"])
    assert args.config == "x.yaml" and args.overrides == ["epochs=2", "lora=true"]
    assert callable(args.func)
