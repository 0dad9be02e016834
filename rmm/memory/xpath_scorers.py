"""Scorers of Semantic XPath's local matches (`rmm.memory.xpath_exec.Scorer`): Atom_loc ∈ [0, 1].

* `CosineScorer` — the paper's *Sem*: the cosine between the encoder's query vector of the match
  text and the node's passage vector (the stored embedding of the memory it shows, else its text
  encoded once and cached). Calibration to [0, 1] is ours (the paper does not say): ``clip``
  (default) keeps max(0, cos) — a normalised encoder's negative cosines mean "unrelated", and
  positive ones stay as the encoder gave them, so products of several matches keep their spread;
  ``affine`` maps [-1, 1] to (cos + 1) / 2 for encoders whose cosines go negative in earnest.
* `EntailmentScorer` — the paper's *Entail*: any Hugging Face sequence-classification folder with an
  entailment label (an MNLI model such as bart-large-mnli); the relevance is the softmax
  probability of entailment with the node's text as premise and the match text, put into
  `hypothesis` (default ``"This text is about {}."``, our choice: the paper gives no template), as
  hypothesis.

The learned reranker's scorer is `rmm.policy.xpath_scorer.RerankerScorer` (a layer up: it needs the
reranker), built on `CosineScorer`'s query hook.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from rmm.encoders.protocol import EncoderLike
from rmm.errors import DimensionMismatchError, ModelNotFoundError
from rmm.memory.xpath_exec import ScorerError

__all__ = ["CALIBRATIONS", "CosineScorer", "EntailmentScorer", "calibrate", "entailment_index"]

log = logging.getLogger(__name__)

Calibration = Literal["clip", "affine"]
CALIBRATIONS: tuple[str, ...] = ("clip", "affine")


def calibrate(cosines: np.ndarray, calibration: str = "clip") -> np.ndarray:
    """Cosines in [-1, 1] to relevances in [0, 1] (module docstring)."""
    if calibration == "clip":
        return np.clip(cosines, 0.0, 1.0)
    if calibration == "affine":
        return np.clip((cosines + 1.0) / 2.0, 0.0, 1.0)
    raise ValueError(f"calibration must be one of {list(CALIBRATIONS)}, got {calibration!r}")


class _Lru(OrderedDict):
    """A bounded map: the oldest entry goes when it is full."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def _unit(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=-1, keepdims=True)
    return matrix / np.where(norms > 0, norms, 1.0)


class CosineScorer:
    """Cosine of the encoder's query and passage vectors, calibrated to [0, 1].

    Query vectors are cached by text (a query repeats its match texts across steps and nodes),
    and so are the passage vectors of texts without a stored embedding (attributes, inner nodes).
    """

    def __init__(self, encoder: EncoderLike, calibration: Calibration = "clip", cache_size: int = 4096) -> None:
        calibrate(np.zeros(1), calibration)  # refuse an unknown calibration now, not at the first query
        self.encoder = encoder
        self.calibration = calibration
        self.name = f"cosine:{encoder.name}"
        self._queries = _Lru(cache_size)
        self._passages = _Lru(cache_size)

    def raw_query(self, query: str) -> np.ndarray:
        """The encoder's query vector [d] (cached)."""
        vector = self._queries.get(query)
        if vector is None:
            with torch.no_grad():
                vector = self.encoder.encode_queries([query])[0].detach().float().cpu().numpy()
            self._queries.put(query, vector)
        return vector

    def query_vector(self, query: str) -> np.ndarray:
        """The unit vector passages are compared with (a reranker's scorer transforms it first)."""
        return _unit(self.raw_query(query))

    def passage_vectors(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self._passages]
        if missing:
            with torch.no_grad():
                encoded = self.encoder.encode_passages(missing).detach().float().cpu().numpy()
            for text, vector in zip(missing, encoded):
                self._passages.put(text, vector)
        return np.stack([self._passages[t] for t in texts]) if texts else np.zeros((0, self.encoder.dim), np.float32)

    def score(self, query: str, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray:
        """Calibrated cosines of `query` with each text (its stored vector when `vectors` is given)."""
        q = self.query_vector(query)
        passages = self.passage_vectors(texts) if vectors is None else np.asarray(vectors, dtype=np.float32)
        if passages.shape[0] and passages.shape[1] != q.shape[0]:
            raise DimensionMismatchError(f"node vectors of dimension {passages.shape[1]} for scorer {self.name} "
                                         f"of dimension {q.shape[0]}: the tree's vectors come from another encoder")
        if vectors is None:
            passages = _unit(passages)  # given vectors are unit rows already (the `Scorer` contract)
        return calibrate(passages @ q, self.calibration)


def entailment_index(id2label: dict[int, str] | dict[str, str]) -> int:
    """The class index whose label names entailment (case-insensitive ``entail…``), or `ScorerError`."""
    found = [int(i) for i, label in id2label.items() if str(label).lower().startswith("entail")]
    if len(found) != 1:
        raise ScorerError(f"the model's labels {dict(id2label)} name no single entailment class; an entailment "
                          "scorer needs an NLI model (e.g. one trained on MNLI)")
    return found[0]


class EntailmentScorer:
    """P(entailment | premise = node text, hypothesis = `hypothesis` with the match text) from an NLI
    sequence-classification model folder. Scores are cached per (text, hypothesis)."""

    def __init__(self, folder: str | Path, hypothesis: str = "This text is about {}.", batch_size: int = 16,
                 max_length: int = 256, device: str = "cpu", cache_size: int = 65536) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(folder)
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"no model folder at {path} (config.json missing); an entailment scorer needs a "
                                     "local sequence-classification model with an entailment label")
        if "{}" not in hypothesis:
            raise ValueError(f"hypothesis must contain '{{}}' where the match text goes, got {hypothesis!r}")
        if batch_size < 1 or max_length < 8:
            raise ValueError(f"need batch_size >= 1 and max_length >= 8, got {batch_size}, {max_length}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.entailment = entailment_index(self.model.config.id2label)
        self.hypothesis = hypothesis
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.name = f"entail:{path.name}"
        self._cache = _Lru(cache_size)

    def score(self, query: str, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray:
        """Entailment probabilities of the hypothesis for `query` by each text (`vectors` unused)."""
        hypothesis = self.hypothesis.format(query)
        missing = [t for t in dict.fromkeys(texts) if (t, hypothesis) not in self._cache]
        for start in range(0, len(missing), self.batch_size):
            batch = missing[start : start + self.batch_size]
            inputs = self.tokenizer(batch, [hypothesis] * len(batch), truncation=True, max_length=self.max_length,
                                    padding=True, return_tensors="pt").to(self.device)
            with torch.no_grad():
                probs = torch.softmax(self.model(**inputs).logits.float(), dim=-1)[:, self.entailment]
            for text, p in zip(batch, probs.cpu().tolist()):
                self._cache.put((text, hypothesis), p)
        return np.array([self._cache[(t, hypothesis)] for t in texts], dtype=np.float64)
