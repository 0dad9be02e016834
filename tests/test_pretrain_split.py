"""One split from pretraining to online training (issue 35, item 11): an encoder folder records the
users it was pretrained on, `rmm pretrain` and `rmm train` hold out the same users by default, and
`rmm train` / `rmm eval` refuse held-out figures on users the encoder trained on."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import write_tiny_locomo
from rmm.cli import main
from rmm.cli.arguments import CheckedParser
from rmm.cli.train import add_train_command_options
from rmm.data import load_dataset
from rmm.encoders import load_encoder
from rmm.encoders.encoder import PRETRAINING_FILE, Pretraining, read_pretraining
from rmm.encoders.random_weights import write_random_encoder
from rmm.errors import CorruptFileError, PretrainedUsersError
from rmm.training.pretrain.data import split_users
from rmm.training.pretrain_config import PretrainConfig, load_config
from rmm.training.splits import hold_out_users, refuse_heldout_on_pretrained, split_questions

REPO = Path(__file__).resolve().parents[1]
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny_encoder_dir(tmp_path: Path, minilm_path: Path) -> Path:
    """A 1-layer random BERT with MiniLM's tokenizer: an rmm encoder folder without a pretraining record."""
    return write_random_encoder("minilm", tmp_path / "tiny-bert", tokenizer_from=minilm_path, **TINY_BERT)


def _pretrained_on(folder: Path, users: list[str], heldout: list[str], *, seed: int = 0,
                   fraction: float = 0.34) -> Path:
    """`folder` as `rmm pretrain` leaves it: weights plus the record of whose conversations trained it."""
    record = Pretraining(dataset="locomo", users=tuple(users), heldout=tuple(heldout), seed=seed,
                         heldout_fraction=fraction)
    (folder / PRETRAINING_FILE).write_text(json.dumps(record.to_json()))
    return folder


@dataclass
class _Settings:
    """What `split_questions` reads of a run's settings."""

    per_user: bool
    heldout_fraction: float
    seed: int


@dataclass
class _Split:
    heldout_users: list[str]


@dataclass
class _Encoder:
    name: str
    pretrained_on: Pretraining | None


def _train_defaults() -> dict:
    """`rmm train`'s built-in settings, read from its own parser."""
    parser = CheckedParser(prog="rmm train")
    add_train_command_options(parser)
    return vars(parser.parse_args([]))


# ------------------------------------------------------------------------------ the default split


def test_pretraining_holds_out_the_conversations_rmm_train_holds_out_by_default(tmp_path: Path) -> None:
    """Before: the CPU example held out 1 of LoCoMo's 10 conversations (conv-48) and rmm train 3."""
    dataset = load_dataset("locomo", write_tiny_locomo(tmp_path / "data" / "locomo" / "locomo10.json", 10).parents[1])
    defaults = _train_defaults()
    train_split = split_questions(dataset, dataset.questions,
                                  _Settings(defaults["per_user"], defaults["heldout"], defaults["seed"]))
    assert len(train_split.heldout_users) == 3
    users = [u for u in dataset.users if dataset.questions_of(u)]
    recipes = [load_config(path) for path in sorted((REPO / "configs" / "pretrain").glob("*.yaml"))]
    assert len(recipes) >= 4  # minilm-locomo-cpu and the GPU recipes
    for recipe in (PretrainConfig(), *recipes):
        pretraining = split_users(users, recipe.val_fraction, recipe.test_fraction, recipe.seed)
        assert sorted(pretraining.test) == sorted(train_split.heldout_users)
        assert not set(pretraining.train) & set(train_split.heldout_users)


def test_one_function_chooses_the_held_out_users_of_both_commands() -> None:
    users = [f"u{i}" for i in range(12)]
    for seed in range(5):
        held, rest = hold_out_users(users, 0.25, seed)
        assert sorted(split_users(users, 0.0, 0.25, seed).test) == sorted(held)
        assert sorted(held + rest) == sorted(users) and len(held) == 3


# ------------------------------------------------------------------------------ the folder's record


def test_pretrain_records_the_users_it_trained_on(tmp_path: Path, tiny_data_dir: Path,
                                                  tiny_encoder_dir: Path) -> None:
    pytest.importorskip("lightning")
    from rmm.training.pretrain import build, run_pretrain

    cfg = PretrainConfig(encoder=str(tiny_encoder_dir), data_dir=str(tiny_data_dir), output_dir=str(tmp_path / "out"),
                         epochs=1, max_steps=1, batch_size=4, max_length=32, accelerator="cpu", devices=1,
                         precision="32-true", checkpoint=False, progress=False, val_fraction=0.0,
                         test_fraction=0.34, eval_ks=[5], eval_before=False)
    report = run_pretrain(cfg)
    users = load_dataset("locomo", tiny_data_dir).users
    split = split_users(users, 0.0, 0.34, 0)
    saved = json.loads((Path(report.output) / PRETRAINING_FILE).read_text())
    assert saved["users"] == split.train and saved["heldout"] == split.test and saved["dataset"] == "locomo"
    record = load_encoder(report.output, device="cpu").pretrained_on
    assert record == Pretraining("locomo", tuple(split.train), tuple(split.test), (), 0, 0.34)

    # pretraining it again with another split would hold out a user it trained on: refused, named
    trained_user = split.train[0]
    seed = next(s for s in range(50) if trained_user in split_users(users, 0.0, 0.34, s).test)
    again = PretrainConfig(**{**cfg.to_dict(), "encoder": report.output, "seed": seed,
                              "output_dir": str(tmp_path / "again")})
    with pytest.raises(PretrainedUsersError, match=trained_user):
        build(again)


def test_pretraining_with_the_online_reranker_checks_the_split_it_runs(tmp_path: Path, tiny_data_dir: Path,
                                                                       tiny_encoder_dir: Path) -> None:
    """`rerank: true` trains a reranker on the pretraining split, set over the online trainer's own
    default one: only the split that runs is checked against the freshly written record."""
    pytest.importorskip("lightning")
    from rmm.training.pretrain import run_pretrain

    users = load_dataset("locomo", tiny_data_dir).users

    def online_default_holds_out_a_trained_user(seed: int) -> bool:
        split = split_users(users, 0.34, 0.34, seed)
        banked = [u for u in users if u in split.test + split.train]
        return hold_out_users(banked, 0.3, seed)[0] == split.train

    seed = next(s for s in range(50) if online_default_holds_out_a_trained_user(s))
    cfg = PretrainConfig(encoder=str(tiny_encoder_dir), data_dir=str(tiny_data_dir), output_dir=str(tmp_path / "out"),
                         epochs=1, max_steps=1, batch_size=4, max_length=32, accelerator="cpu", devices=1,
                         precision="32-true", checkpoint=False, progress=False, val_fraction=0.34,
                         test_fraction=0.34, eval_ks=[5], eval_before=False, rerank=True, seed=seed)
    report = run_pretrain(cfg)
    assert report.rerank_after["reranker_heldout"]
    assert load_encoder(report.output, device="cpu").pretrained_on.users == tuple(split_users(users, 0.34, 0.34,
                                                                                              seed).train)


def test_a_folder_without_a_record_is_any_hf_model(minilm_path: Path, tiny_encoder_dir: Path) -> None:
    assert read_pretraining(minilm_path) is None
    assert load_encoder(str(minilm_path), device="cpu").pretrained_on is None
    assert load_encoder("minilm", device="cpu").pretrained_on is None
    encoder = load_encoder(str(tiny_encoder_dir), device="cpu")
    assert encoder.pretrained_on is None
    refuse_heldout_on_pretrained(encoder, "locomo", _Split(["conv-0", "conv-1"]), per_user=True)  # accepted


def test_a_corrupt_record_is_a_typed_error(tiny_encoder_dir: Path) -> None:
    (tiny_encoder_dir / PRETRAINING_FILE).write_text("{not json")
    with pytest.raises(CorruptFileError, match=PRETRAINING_FILE):
        load_encoder(str(tiny_encoder_dir), device="cpu")


def test_saving_a_pretrained_encoder_keeps_its_record(tmp_path: Path, tiny_encoder_dir: Path) -> None:
    _pretrained_on(tiny_encoder_dir, ["conv-1", "conv-2"], ["conv-0"])
    copy = load_encoder(str(tiny_encoder_dir), device="cpu").save(tmp_path / "copy")
    assert read_pretraining(copy) == read_pretraining(tiny_encoder_dir)


# ------------------------------------------------------------------------------ the refusals


def test_rmm_train_refuses_held_out_figures_on_pretrained_users(
        tiny_data_dir: Path, tiny_encoder_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    users = load_dataset("locomo", tiny_data_dir).users
    held, _ = hold_out_users(users, 0.34, 0)
    _pretrained_on(tiny_encoder_dir, users, [])  # trained on every conversation, the held-out one included
    for retriever in (str(tiny_encoder_dir), f"hybrid:{tiny_encoder_dir}"):
        code = main(["train", "--data-dir", str(tiny_data_dir), "--retriever", retriever, "--k", "8",
                     "--heldout", "0.34", "--json", str(tmp_path / "train.json")])
        out = capsys.readouterr()
        assert code == 2 and "Traceback" not in out.out + out.err
        assert "error:" in out.out and f"pretrained on locomo user {held[0]}" in " ".join(out.out.split())
        assert not (tmp_path / "train.json").exists()
    # per-user mode holds out later questions of every user: refused as well, naming all three
    code = main(["train", "--data-dir", str(tiny_data_dir), "--retriever", str(tiny_encoder_dir), "--k", "8",
                 "--per-user"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "conv-0, conv-1, conv-2" in printed and "without --per-user" in printed


def test_rmm_train_accepts_an_encoder_pretrained_with_its_split(tiny_data_dir: Path, tiny_encoder_dir: Path,
                                                                tmp_path: Path) -> None:
    users = load_dataset("locomo", tiny_data_dir).users
    held, rest = hold_out_users(users, 0.34, 0)
    _pretrained_on(tiny_encoder_dir, rest, held)
    out = tmp_path / "train.json"
    assert main(["train", "--data-dir", str(tiny_data_dir), "--retriever", str(tiny_encoder_dir), "--k", "8",
                 "--heldout", "0.34", "--epochs", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["split_users"]["heldout"] == held


def test_refusal_names_only_the_held_out_users_it_saw() -> None:
    record = Pretraining("locomo", ("a", "b"), ("c",), seed=0, heldout_fraction=0.3)
    split = _Split(["b", "c"])
    encoder = _Encoder("enc", record)
    with pytest.raises(PretrainedUsersError, match=r"^enc was pretrained on locomo user b: .*--heldout 0.3 --seed 0"):
        refuse_heldout_on_pretrained(encoder, "locomo", split, per_user=False)
    refuse_heldout_on_pretrained(encoder, "msc", split, per_user=False)  # another dataset's users: not comparable
    refuse_heldout_on_pretrained(_Encoder("enc", None), "locomo", split, per_user=False)  # no record: accepted


def test_rmm_eval_refuses_an_encoder_pretrained_on_the_users_it_scores(
        tiny_data_dir: Path, tiny_encoder_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    users = load_dataset("locomo", tiny_data_dir).users
    held, rest = hold_out_users(users, 0.34, 0)
    _pretrained_on(tiny_encoder_dir, rest, held)
    for retriever in (str(tiny_encoder_dir), f"hybrid:{tiny_encoder_dir}", f"bm25:{tiny_encoder_dir}"):
        code = main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25", retriever, "--k", "5"])
        out = capsys.readouterr()
        printed = " ".join(out.out.split())
        assert code == 2 and "Traceback" not in out.out + out.err
        seen = [u for u in users if u in rest]  # named in the dataset's order
        assert f"pretrained on locomo users {', '.join(seen)}" in printed and "rmm train" in printed
        assert "R@5" not in printed  # refused before any retriever was scored


def test_rmm_eval_accepts_a_folder_without_a_record(tiny_data_dir: Path, minilm_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "plain-minilm"
    shutil.copytree(minilm_path, folder)
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", str(folder), "--k", "5"]) == 0


def test_an_encoder_pretrained_again_keeps_the_users_it_saw_before() -> None:
    first = Pretraining("locomo", ("a", "b"), ("c", "d"), seed=0, heldout_fraction=0.5)
    second = Pretraining("locomo", ("c",), ("d",), seed=1, heldout_fraction=0.3)
    assert second.merged(first).users == ("a", "b", "c") and second.merged(first).heldout == ("d",)
    assert second.merged(None) == second
    assert second.merged(Pretraining("msc", ("a",))) == second  # another dataset's ids are not comparable
