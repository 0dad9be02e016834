"""`rmm pretrain` as a user meets it: one line per event, Ctrl-C, the one resumable checkpoint,
pre-tokenised batches, length bucketing, torch.compile wiring, and the random-weight encoders."""

from __future__ import annotations

import io
import logging
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L

from rmm.encoders import load_encoder
from rmm.encoders.random_weights import write_random_encoder
from rmm.training.pretrain import NoDuplicateBatchSampler, build, make_trainer, run_pretrain
from rmm.training.pretrain.console import lightning_console
from rmm.training.pretrain.driver import PretrainInterrupted, checkpoint_path
from rmm.training.pretrain_config import PretrainConfig, PretrainConfigError
from test_pretrain import pair, tiny_config

TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}


@pytest.fixture
def tiny_encoder_dir(tmp_path: Path, minilm_path: Path) -> Path:
    """A 1-layer random BERT with MiniLM's tokenizer (fast to train)."""
    return write_random_encoder("minilm", tmp_path / "tiny-bert", tokenizer_from=minilm_path, **TINY_BERT)


class InterruptAt(L.Callback):
    """Ctrl-C as Lightning sees it: a KeyboardInterrupt raised from inside `fit`."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer: L.Trainer, module: object, batch: object, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            raise KeyboardInterrupt


@pytest.fixture
def screen() -> io.StringIO:
    """A root handler that shows every library's INFO: where Lightning used to print each line twice."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(saved)


def test_lightning_prints_each_event_once_without_advertisements(screen: io.StringIO,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    own = logging.getLogger("lightning")
    assert own.handlers, "Lightning installs a handler of its own on import (the cause of the duplicates)"
    with lightning_console():
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing [litlogger]")
        import warnings

        from torch.utils._pytree import LeafSpec

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            with lightning_console():
                isinstance(LeafSpec(), LeafSpec)
    lines = screen.getvalue().splitlines() + capfd.readouterr().err.splitlines()
    assert sum("GPU available" in line for line in lines) == 1
    assert not any("Tip" in line for line in lines)
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    assert own.handlers  # restored after the block


def test_run_prints_one_line_per_event_and_the_before_figure_before_training(
        tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path, screen: io.StringIO,
        capfd: pytest.CaptureFixture[str]) -> None:
    run_pretrain(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, max_steps=2, checkpoint=True))
    lines = [line for line in screen.getvalue().splitlines() + capfd.readouterr().err.splitlines()
             if line.strip() and "it/s]" not in line]  # log lines, not transformers' load bars (the CLI hides them)
    repeated = {line: n for line, n in Counter(lines).items() if n > 1}
    assert not repeated
    assert not [line for line in lines if "Tip" in line or "LeafSpec" in line]
    assert sum("`Trainer.fit` stopped" in line for line in lines) == 1  # Lightning's events still shown, once
    before = next(i for i, line in enumerate(lines) if "recall before pretraining" in line)
    training = next(i for i, line in enumerate(lines) if "rmm.training.pretrain.driver: training " in line)
    assert before < training


def test_ctrl_c_names_the_last_checkpoint_and_resuming_finishes_the_run(
        tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, epochs=2, checkpoint=True, val_fraction=0.34,
                      eval_before=False)
    sigint = signal.getsignal(signal.SIGINT)
    with pytest.raises(PretrainInterrupted) as interrupted:
        run_pretrain(cfg, callbacks=[InterruptAt(epoch=1, batch=1)])
    assert isinstance(interrupted.value, KeyboardInterrupt)
    assert str(interrupted.value).startswith(f"interrupted — last checkpoint at {checkpoint_path(cfg)}")
    assert signal.getsignal(signal.SIGINT) is sigint  # Lightning leaves SIGINT ignored; we put it back
    # exactly what resuming needs: one file with weights, optimiser, schedule and loop state
    assert sorted(p.name for p in checkpoint_path(cfg).parent.iterdir()) == ["last.ckpt"]
    state = torch.load(checkpoint_path(cfg), map_location="cpu", weights_only=False)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch"} <= set(state)
    assert state["epoch"] == 0 and len(state["optimizer_states"]) == 1
    steps_per_epoch = state["global_step"]
    resumed = run_pretrain(PretrainConfig(**{**cfg.to_dict(), "resume_from": "last"}))
    assert resumed.steps == steps_per_epoch  # only the second epoch ran
    assert sorted(p.name for p in checkpoint_path(cfg).parent.iterdir()) == ["last.ckpt"]
    assert torch.load(checkpoint_path(cfg), map_location="cpu", weights_only=False)["epoch"] == 1


def test_ctrl_c_before_any_checkpoint_says_so(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, checkpoint=True, eval_before=False)
    with pytest.raises(PretrainInterrupted, match="no checkpoint yet"):
        run_pretrain(cfg, callbacks=[InterruptAt(epoch=0, batch=0)])


def test_resume_from_a_missing_checkpoint_is_one_clear_error(tmp_path: Path, tiny_data_dir: Path,
                                                            tiny_encoder_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, resume_from="last")
    with pytest.raises(PretrainConfigError, match="resume_from: no checkpoint at .*last.ckpt"):
        run_pretrain(cfg)


def test_batches_need_no_tokeniser_after_setup(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path) -> None:
    _, data = build(tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, hard_negatives=2))
    data.setup("fit")
    data.mine()
    expected = data.collate("train", [0, 1, 2])

    def no_tokeniser(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenised during a step")

    data.encoder.tokenizer = no_tokeniser
    for split in ("train", "val", "test"):
        for start in range(0, len(data.pairs[split]), 3):
            data.collate(split, list(range(start, min(start + 3, len(data.pairs[split])))))
    again = data.collate("train", [0, 1, 2])
    assert again["counts"] == expected["counts"] == (3, 3, 6)
    for got, want in zip(again["passes"], expected["passes"], strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])


def test_length_bucketing_groups_similar_lengths_and_keeps_the_guarantees() -> None:
    pairs = [pair(f"q{i}", f"p{i % 37}") for i in range(200)]
    lengths = [(i * 7919) % 97 + 3 for i in range(200)]

    def spread(sampler: NoDuplicateBatchSampler) -> float:
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(200))
        for batch in batches:
            passages = [pairs[i].passage for i in batch]
            assert len(passages) == len(set(passages))  # still no false negatives
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    plain = spread(NoDuplicateBatchSampler(pairs, 8, seed=0))
    bucketed = spread(NoDuplicateBatchSampler(pairs, 8, seed=0, lengths=lengths))
    assert bucketed < plain / 3
    with pytest.raises(ValueError, match="lengths"):
        NoDuplicateBatchSampler(pairs, 8, lengths=lengths[:3])


def test_torch_compile_compiles_the_transformer_in_place(tmp_path: Path, tiny_data_dir: Path,
                                                         tiny_encoder_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.nn.Module, dict]] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((self, kw)))
    cfg = tiny_config(tmp_path, tiny_data_dir, tiny_encoder_dir, max_steps=1, torch_compile=True)
    module, data = build(cfg)
    module.train()
    make_trainer(cfg).fit(module, datamodule=data)
    assert calls == [(module.model, {"dynamic": True})]
    names_before = set(module.model.state_dict())
    assert all(not name.startswith("_orig_mod") for name in names_before)


def test_random_weight_encoder_has_the_architecture_and_reads_like_sentence_transformers(tmp_path: Path) -> None:
    folder = write_random_encoder("minilm", tmp_path / "m", **TINY_BERT)
    encoder = load_encoder(str(folder), device="cpu")
    assert encoder.dim == 32 and encoder.config.normalize and encoder.config.pooling == "mean"
    texts = ["Ana: I went hiking", "What did Ben bake?"]
    vectors = encoder.encode_passages(texts)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(2), atol=1e-5)
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(vectors, theirs.float().cpu(), atol=1e-5)
    contriever = load_encoder(str(write_random_encoder("bert-base", tmp_path / "c", **TINY_BERT)), device="cpu")
    assert not contriever.config.normalize and contriever.model.config.num_hidden_layers == 1
    with pytest.raises(Exception, match="unknown architecture 'gpt'"):
        write_random_encoder("gpt", tmp_path / "g")


def cli_overrides(tmp_path: Path, data_dir: Path, encoder: Path, **extra: object) -> list[str]:
    cfg = tiny_config(tmp_path, data_dir, encoder, **extra)
    return [f"{key}={value}" for key, value in cfg.to_dict().items()
            if key in {"encoder", "data_dir", "output_dir", "epochs", "batch_size", "max_length", "accelerator",
                       "devices", "precision", "checkpoint", "progress", "val_fraction", "test_fraction",
                       "max_steps", "eval_before"} | set(extra)]


def test_rmm_pretrain_shows_each_line_once(tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    from rmm.cli import main

    assert main(["pretrain", *cli_overrides(tmp_path, tiny_data_dir, tiny_encoder_dir, max_steps=2,
                                             checkpoint=True)]) == 0
    captured = capfd.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert not {line for line, n in Counter(lines).items() if n > 1}
    assert not [line for line in lines if "Tip" in line or "LeafSpec" in line or line.startswith("INFO: ")]
    assert any("held-out recall before pretraining" in line for line in lines)
    assert any(line.startswith("held-out recall@5: before") for line in lines)


def test_rmm_pretrain_ctrl_c_exits_130_with_the_checkpoint_and_the_resume_command(
        tmp_path: Path, tiny_data_dir: Path, tiny_encoder_dir: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from rmm.training import pretrain
    from rmm.cli import main

    monkeypatch.setattr(pretrain, "run_pretrain",
                        functools.partial(pretrain.run_pretrain, callbacks=[InterruptAt(epoch=1, batch=0)]))
    overrides = cli_overrides(tmp_path, tiny_data_dir, tiny_encoder_dir, epochs=2, checkpoint=True, eval_before=False)
    assert main(["pretrain", *overrides]) == 130
    err = capfd.readouterr().err
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    assert f"interrupted — last checkpoint at {last}" in err
    resume = next(line for line in err.splitlines() if line.startswith("resume with: "))
    assert resume.endswith(" resume_from=last") and "rmm pretrain" in resume
    assert "Traceback" not in err
