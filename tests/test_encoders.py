"""Encoders: pooling paths against hand computations on tiny random models, folder formats, presets."""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from rmm.encoders import (
    PRESETS,
    DenseHead,
    Encoder,
    EncoderConfig,
    EncoderError,
    load_encoder,
    pool,
)
from rmm.encoders.encoder import OneDnnLinear, onednn_linear_available
from rmm.encoders.presets import GTE_DEFAULT_TASK, gte_query_prefix
from rmm.errors import CorruptFileError, ModelNotFoundError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
TEXTS = [
    "hi",
    "Caroline: I went to the LGBTQ support group yesterday and it was so powerful.",
    "Melanie: wow",
    "a somewhat longer sentence about painting a sunrise over the lake with the kids last summer",
    "",
    "ok then",
]
ATOL = 2e-5


# ---------------------------------------------------------------- tiny models


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A 2-layer random BERT using MiniLM's (uncased WordPiece) tokenizer."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    _copy_tokenizer(minilm_path, folder)
    return folder


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A 2-layer random causal Qwen2 (rotary positions) with the same WordPiece vocabulary."""
    from transformers import Qwen2Config, Qwen2Model

    folder = tmp_path_factory.mktemp("tiny_qwen")
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0)
    Qwen2Model(config).save_pretrained(folder)
    _copy_tokenizer(minilm_path, folder)
    return folder


@functools.lru_cache(maxsize=8)
def _reference_model(folder: Path) -> tuple[object, torch.nn.Module]:
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()


def _reference_hidden(folder: Path, text: str) -> torch.Tensor:
    """Hidden states of one text alone (no padding), from an independently loaded model."""
    tokenizer, model = _reference_model(folder)
    ids = tokenizer(text, return_tensors="pt", return_token_type_ids=False)
    with torch.inference_mode():
        return model(**ids).last_hidden_state[0]


def _encoder(folder: Path, **fields: object) -> Encoder:
    options = {key: fields.pop(key) for key in ("batch_size", "onednn") if key in fields}
    return Encoder(EncoderConfig(name="tiny", model_path=folder, **fields), device="cpu", **options)


# ---------------------------------------------------------------- pool()


@pytest.fixture()
def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    hidden = torch.randn(3, 5, 4)
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    left = right.flip(1)
    return hidden, right, left


def test_mean_pool_ignores_padding(padded_batch) -> None:
    hidden, right, _ = padded_batch
    hidden[1, 3:] = float("nan")  # pad rows some kernels leave as NaN must not leak
    expected = torch.stack([hidden[0].mean(0), hidden[1, :3].mean(0), hidden[2, :1].mean(0)])
    assert torch.allclose(pool(hidden, right, "mean"), expected, atol=1e-6)


def test_cls_pool_takes_first_real_token_on_either_side(padded_batch) -> None:
    hidden, right, left = padded_batch
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.equal(pool(hidden, left, "cls"), torch.stack([hidden[0, 0], hidden[1, 2], hidden[2, 4]]))


def test_last_pool_with_right_and_left_padding(padded_batch) -> None:
    hidden, right, left = padded_batch
    assert torch.equal(pool(hidden, right, "last"), torch.stack([hidden[0, 4], hidden[1, 2], hidden[2, 0]]))
    assert torch.equal(pool(hidden, left, "last"), hidden[:, -1])


def test_max_pool_ignores_padding(padded_batch) -> None:
    hidden, right, _ = padded_batch
    hidden[1, 3:] = 100.0
    expected = torch.stack([hidden[0].amax(0), hidden[1, :3].amax(0), hidden[2, 0]])
    assert torch.equal(pool(hidden, right, "max"), expected)


def test_pool_rejects_bad_mode_and_shapes(padded_batch) -> None:
    hidden, right, _ = padded_batch
    with pytest.raises(EncoderError, match="pooling mode"):
        pool(hidden, right, "median")
    with pytest.raises(EncoderError, match="attention_mask"):
        pool(hidden, right[:, :3], "mean")


# ---------------------------------------------------------------- Encoder on tiny models


def test_mean_pooling_matches_each_text_alone(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, pooling="mean", batch_size=4)
    got = encoder.encode_passages(TEXTS)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (len(TEXTS), 32)
    for row, text in zip(got, TEXTS):
        assert torch.allclose(row, _reference_hidden(tiny_bert, text).mean(0), atol=ATOL)


def test_cls_pooling_matches_first_token(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, pooling="cls", batch_size=3)
    got = encoder.encode_passages(TEXTS)
    for row, text in zip(got, TEXTS):
        assert torch.allclose(row, _reference_hidden(tiny_bert, text)[0], atol=ATOL)


def test_max_pooling_matches_hand_computation(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, pooling="max", batch_size=8)
    got = encoder.encode_passages(TEXTS)
    for row, text in zip(got, TEXTS):
        assert torch.allclose(row, _reference_hidden(tiny_bert, text).amax(0), atol=ATOL)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_last_token_pooling_on_causal_model_either_padding(tiny_qwen: Path, padding_side: str) -> None:
    encoder = _encoder(tiny_qwen, pooling="last", padding_side=padding_side, batch_size=8)
    assert encoder.padding_side == padding_side
    got = encoder.encode_passages(TEXTS)
    for row, text in zip(got, TEXTS):
        assert torch.allclose(row, _reference_hidden(tiny_qwen, text)[-1], atol=ATOL)


def test_last_pooling_pads_left_by_default(tiny_qwen: Path) -> None:
    assert _encoder(tiny_qwen, pooling="last").padding_side == "left"


def test_batch_order_restored_under_length_sorting(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, batch_size=2)
    forward = encoder.encode_passages(TEXTS)
    permutation = [3, 0, 5, 1, 4, 2]
    shuffled = encoder.encode_passages([TEXTS[i] for i in permutation])
    assert torch.allclose(shuffled, forward[permutation], atol=ATOL)
    assert not torch.allclose(forward[0], forward[1])  # distinct rows, so order is observable


def test_prefixes_apply_to_queries_and_passages_separately(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, query_prefix="query: ", passage_prefix="passage: ")
    plain = _encoder(tiny_bert)
    assert torch.allclose(encoder.encode_queries(["cats"]), plain.encode_passages(["query: cats"]), atol=ATOL)
    assert torch.allclose(encoder.encode_passages(["cats"]), plain.encode_passages(["passage: cats"]), atol=ATOL)
    assert not torch.allclose(encoder.encode_queries(["cats"]), encoder.encode_passages(["cats"]), atol=1e-3)


def test_max_length_truncates(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert, max_length=8)
    long_text = "word " * 100
    assert max(len(ids) for ids in encoder.tokenize([long_text])) == 8
    truncated = encoder.tokenizer.decode(encoder.tokenize([long_text])[0][1:-1])
    assert torch.allclose(encoder.encode_passages([long_text]), encoder.encode_passages([truncated]), atol=ATOL)


def test_empty_and_bad_inputs(tiny_bert: Path) -> None:
    encoder = _encoder(tiny_bert)
    assert encoder.encode_queries([]).shape == (0, 32)
    with pytest.raises(EncoderError, match="single string"):
        encoder.encode_queries("just one")  # type: ignore[arg-type]
    with pytest.raises(EncoderError, match="not str"):
        encoder.encode_passages(["ok", 3])  # type: ignore[list-item]


def test_bad_config_values_raise() -> None:
    with pytest.raises(EncoderError, match="pooling"):
        EncoderConfig(name="x", model_path="x", pooling="avg")
    with pytest.raises(EncoderError, match="max_length"):
        EncoderConfig(name="x", model_path="x", max_length=0)
    with pytest.raises(EncoderError, match="padding_side"):
        EncoderConfig(name="x", model_path="x", padding_side="middle")


def test_progress_bar_only_for_large_inputs(tiny_bert: Path, capsys: pytest.CaptureFixture[str],
                                            caplog: pytest.LogCaptureFixture) -> None:
    encoder = _encoder(tiny_bert, batch_size=256)
    caplog.set_level(logging.INFO, logger="rmm.encoders.encoder")
    encoder.encode_passages(["hello"] * 1001)
    assert "encoding (tiny)" in capsys.readouterr().err
    encoder.encode_passages(["hello"] * 10)
    assert "encoding" not in capsys.readouterr().err
    caplog.set_level(logging.WARNING, logger="rmm.encoders.encoder")
    encoder.encode_passages(["hello"] * 1001)
    assert "encoding" not in capsys.readouterr().err


def test_onednn_linear_is_exact_enough_and_falls_back_under_autograd(tiny_bert: Path) -> None:
    if not onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = OneDnnLinear
    x = torch.randn(4, 3, 16)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert layer(x).requires_grad  # the autograd path is the ordinary one
    fast = _encoder(tiny_bert, onednn=True).encode_passages(TEXTS)
    slow = _encoder(tiny_bert, onednn=False).encode_passages(TEXTS)
    assert torch.allclose(fast, slow, atol=ATOL)


# ---------------------------------------------------------------- dense head, ST folders, save/load


def _write_dense(folder: Path, in_features: int, out_features: int, activation: str | None,
                 file_name: str = "model.safetensors", seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.3
    bias = torch.randn(out_features, generator=generator) * 0.1
    config: dict[str, object] = {"in_features": in_features, "out_features": out_features, "bias": True}
    if activation is not None:
        config["activation_function"] = activation
    (folder / "config.json").write_text(json.dumps(config))
    state = {"linear.weight": weight, "linear.bias": bias}
    if file_name.endswith(".bin"):
        torch.save(state, folder / file_name)
    else:
        save_file(state, str(folder / file_name))
    return weight, bias


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Path:
    """A sentence-transformers folder: tiny BERT → CLS pooling → Dense(32→16, tanh) → Normalize."""
    folder = tmp_path_factory.mktemp("st_model")
    for item in tiny_bert.iterdir():
        shutil.copy(item, folder / item.name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    _write_dense(folder / "2_Dense", 32, 16, "torch.nn.modules.activation.Tanh")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "document": "passage: "}, "default_prompt_name": None}))
    return folder


def test_sentence_transformers_folder_is_parsed(st_folder: Path) -> None:
    encoder = load_encoder(str(st_folder), device="cpu")
    config = encoder.config
    assert (config.pooling, config.normalize, config.max_length) == ("cls", True, 24)
    assert (config.query_prefix, config.passage_prefix) == ("query: ", "passage: ")
    assert Path(config.dense_path) == st_folder / "2_Dense" and encoder.dim == 16
    assert encoder.dense is not None and isinstance(encoder.dense.activation, torch.nn.Tanh)


def test_dense_head_and_normalisation_match_hand_computation(st_folder: Path) -> None:
    encoder = load_encoder(str(st_folder), device="cpu")
    state = load_file(str(st_folder / "2_Dense" / "model.safetensors"))
    got = encoder.encode_passages(TEXTS[:3])
    for row, text in zip(got, TEXTS[:3]):
        cls = _reference_hidden(st_folder, "passage: " + text)[0]
        expected = F.normalize(torch.tanh(state["linear.weight"] @ cls + state["linear.bias"]), dim=0)
        assert torch.allclose(row, expected, atol=ATOL)
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)


def test_sentence_transformers_folder_matches_sentence_transformers(st_folder: Path) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(str(st_folder), device="cpu")
    encoder = load_encoder(str(st_folder), device="cpu")
    assert torch.allclose(encoder.encode_queries(TEXTS),
                          reference.encode_query(TEXTS, convert_to_tensor=True), atol=ATOL)
    assert torch.allclose(encoder.encode_passages(TEXTS),
                          reference.encode_document(TEXTS, convert_to_tensor=True), atol=ATOL)


def test_sentence_transformers_folder_with_unsupported_pooling(tmp_path: Path, st_folder: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(st_folder, folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(EncoderError, match="weightedmean"):
        load_encoder(str(folder))


def test_dense_head_reads_pytorch_bin_and_identity(tmp_path: Path, tiny_bert: Path) -> None:
    weight, bias = _write_dense(tmp_path / "2_Dense_16", 32, 16, "torch.nn.modules.linear.Identity",
                                file_name="pytorch_model.bin")
    encoder = _encoder(tiny_bert, pooling="mean", dense_path=tmp_path / "2_Dense_16", normalize=False)
    mean = _reference_hidden(tiny_bert, "hello there").mean(0)
    assert torch.allclose(encoder.encode_passages(["hello there"])[0], weight @ mean + bias, atol=ATOL)


def test_dense_head_rejects_unknown_activation_and_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(
        {"in_features": 4, "out_features": 2, "activation_function": "os.system"}))
    with pytest.raises(EncoderError, match="activation"):
        DenseHead.load(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"in_features": 4, "out_features": 2}))
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        DenseHead.load(tmp_path / "empty")


def test_plain_hf_folder_defaults_to_mean_and_accepts_overrides(tiny_bert: Path) -> None:
    encoder = load_encoder(str(tiny_bert), device="cpu")
    assert (encoder.config.pooling, encoder.config.normalize, encoder.config.dense_path) == ("mean", False, None)
    assert encoder.config.max_length == 64  # the tokenizer's 512 capped by the model's positions
    overridden = load_encoder(str(tiny_bert), pooling="cls", normalize=True, query_prefix="q: ", device="cpu")
    assert (overridden.config.pooling, overridden.config.normalize, overridden.config.query_prefix) == (
        "cls", True, "q: ")
    assert overridden.fingerprint != encoder.fingerprint
    with pytest.raises(EncoderError, match="unknown encoder option"):
        load_encoder(str(tiny_bert), poolng="cls")


def test_save_and_load_roundtrip(tmp_path: Path, st_folder: Path) -> None:
    encoder = load_encoder(str(st_folder), device="cpu", passage_prefix="doc: ")
    saved = encoder.save(tmp_path / "saved")
    assert json.loads((saved / "rmm_encoder.json").read_text())["pooling"] == "cls"
    reloaded = load_encoder(str(saved), device="cpu")
    assert reloaded.config.portable_dict() == encoder.config.portable_dict()
    assert reloaded.fingerprint == encoder.fingerprint and reloaded.dim == encoder.dim
    assert torch.allclose(reloaded.encode_queries(TEXTS), encoder.encode_queries(TEXTS), atol=1e-6)
    assert torch.allclose(reloaded.encode_passages(TEXTS), encoder.encode_passages(TEXTS), atol=1e-6)


def test_corrupt_rmm_encoder_file(tmp_path: Path, tiny_bert: Path) -> None:
    folder = tmp_path / "enc"
    shutil.copytree(tiny_bert, folder)
    (folder / "rmm_encoder.json").write_text("{not json")
    with pytest.raises(CorruptFileError):
        load_encoder(str(folder))


def test_fingerprint_is_stable_and_tracks_the_embedding_function(tiny_bert: Path, tiny_qwen: Path) -> None:
    base = _encoder(tiny_bert)
    assert _encoder(tiny_bert).fingerprint == base.fingerprint
    assert _encoder(tiny_bert, query_prefix="q: ").fingerprint == base.fingerprint  # queries only
    for changed in (_encoder(tiny_bert, normalize=True), _encoder(tiny_bert, pooling="cls"),
                    _encoder(tiny_bert, passage_prefix="p: "), _encoder(tiny_qwen)):
        assert changed.fingerprint != base.fingerprint


# ---------------------------------------------------------------- presets and missing models


def test_missing_folder_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download"):
        load_encoder(str(tmp_path / "no_such_model"))
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        Encoder(EncoderConfig(name="x", model_path=tmp_path / "no_such_model"))


def test_missing_preset_names_repo_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.delenv("RMM_CONTRIEVER_PATH", raising=False)
    with pytest.raises(ModelNotFoundError) as caught:
        load_encoder("contriever")
    message = str(caught.value)
    assert "facebook/contriever" in message and "RMM_CONTRIEVER_PATH" in message
    assert "huggingface-cli download facebook/contriever" in message


def test_preset_resolves_from_local_hf_cache(tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / "models--facebook--contriever"
    shutil.copytree(tiny_bert, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("RMM_CONTRIEVER_PATH", raising=False)
    encoder = load_encoder("contriever", device="cpu")
    assert encoder.name == "contriever" and encoder.config.pooling == "mean" and not encoder.config.normalize
    assert Path(encoder.config.model_path).name == commit


def test_gte_preset_settings_and_task(tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMM_GTE_PATH", str(tiny_qwen))
    encoder = load_encoder("gte", device="cpu")
    config = encoder.config
    assert (config.pooling, config.normalize, encoder.padding_side) == ("last", True, "left")
    assert config.query_prefix == f"Instruction: {GTE_DEFAULT_TASK}\nQuery: " and config.passage_prefix == ""
    assert torch.allclose(encoder.encode_passages(TEXTS).norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    query = encoder.encode_queries(["where did Caroline go?"])[0]
    expected = F.normalize(_reference_hidden(tiny_qwen, gte_query_prefix() + "where did Caroline go?")[-1], dim=0)
    assert torch.allclose(query, expected, atol=ATOL)
    custom = load_encoder("gte", task="Find the fact.", device="cpu")
    assert custom.config.query_prefix == "Instruction: Find the fact.\nQuery: "
    with pytest.raises(EncoderError, match="task"):
        load_encoder(str(tiny_qwen), task="Find the fact.")


def test_stella_preset_uses_its_dense_1024_folder(tmp_path: Path, tiny_qwen: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "stella"
    shutil.copytree(tiny_qwen, folder)
    weight, bias = _write_dense(folder / "2_Dense_1024", 32, 24, None, file_name="pytorch_model.bin")
    monkeypatch.setenv("RMM_STELLA_PATH", str(folder))
    encoder = load_encoder("stella", device="cpu")
    assert encoder.dim == 24 and encoder.config.pooling == "mean" and encoder.config.query_prefix == ""
    got = encoder.encode_queries(["hello there"])[0]
    mean = _reference_hidden(folder, "hello there").mean(0)
    # no activation in the config means sentence-transformers' default, tanh
    assert torch.allclose(got, F.normalize(torch.tanh(weight @ mean + bias), dim=0), atol=ATOL)
    (folder / "2_Dense_1024" / "pytorch_model.bin").unlink()
    with pytest.raises(ModelNotFoundError):
        load_encoder("stella")


def test_preset_table() -> None:
    assert set(PRESETS) == {"minilm", "contriever", "stella", "gte"}
    assert PRESETS["contriever"].hf_repos == ("facebook/contriever",) and not PRESETS["contriever"].normalize
    assert PRESETS["stella"].dense_subdir == "2_Dense_1024" and PRESETS["stella"].normalize
    assert PRESETS["gte"].pooling == "last" and PRESETS["gte"].normalize


# ---------------------------------------------------------------- the real default model


def test_minilm_matches_sentence_transformers(minilm_path: Path) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    encoder = load_encoder("minilm", device="cpu")
    assert encoder.dim == 384 and encoder.config.normalize and encoder.config.max_length == 256
    assert Path(encoder.config.model_path) == minilm_path
    texts = TEXTS + ["Melanie: I painted a lake sunrise last year! [image: a painting of a sunset]" * 12]
    reference = sentence_transformers.SentenceTransformer(str(minilm_path), device="cpu")
    expected = reference.encode(texts, convert_to_tensor=True)
    got = encoder.encode_passages(texts)
    assert F.cosine_similarity(got, expected, dim=1).min() > 1 - 1e-4
    assert (got - expected).abs().max() < 1e-4
