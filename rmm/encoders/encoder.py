"""A dense text encoder: HF transformer → pooling → optional dense head → optional L2 norm.

One class covers Contriever, Stella, GTE, MiniLM and any local HF / sentence-transformers folder,
because they differ only in pooling, the head after it, normalisation and the text prefixes.
Nothing is downloaded here: a model folder must already be on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors
from torch import Tensor, nn

from rmm.device import default_dtype, resolve_device
from rmm.encoders.cuda_graphs import InferenceGraphs
from rmm.encoders.passage_cache import PassageCache, token_key
from rmm.encoders.pooling import EncoderError, check_pooling_mode, pool
from rmm.errors import CorruptFileError, ModelNotFoundError

logger = logging.getLogger(__name__)

RMM_ENCODER_FILE = "rmm_encoder.json"
RMM_ENCODER_FORMAT = 1
# Whose data an encoder folder was pretrained on (`rmm pretrain` writes it; absent elsewhere).
PRETRAINING_FILE = "rmm_pretraining.json"
PRETRAINING_FORMAT = 1
DENSE_SUBDIR = "dense"
PROGRESS_THRESHOLD = 1000
# On a CPU a batch stops growing at this many (padded) tokens: past it the activations leave the
# cache and every elementwise op runs from memory (all-MiniLM-L6-v2 on LoCoMo, one thread: 512-2048
# tokens ~1.15x faster on short turns and ~1.6x on 256-token topics than 64 texts a batch).
CPU_BATCH_TOKENS = 1024
PADDING_SIDES = ("left", "right")

# sentence-transformers writes the activation as a dotted class path; only plain torch modules are
# accepted (importing an arbitrary path from a downloaded folder would run foreign code).
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}
_ACTIVATION_ALIASES = {"identity": "torch.nn.modules.linear.Identity", "tanh": "torch.nn.modules.activation.Tanh",
                       "relu": "torch.nn.modules.activation.ReLU", "gelu": "torch.nn.modules.activation.GELU",
                       "sigmoid": "torch.nn.modules.activation.Sigmoid"}
# sentence-transformers' Dense default when a config names no activation
ST_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"


@dataclass
class EncoderConfig:
    """What turns a model folder into an embedding function (paths aside, saved as rmm_encoder.json).

    `trust_remote_code` and `padding_side` are additions to the contract's fields, both defaulted:
    Stella and GTE ship their own (bidirectional) modelling code, and last-token pooling wants
    left padding (`padding_side=None` picks left for `pooling="last"`, else the tokenizer's side).
    """

    name: str
    model_path: str | Path
    pooling: str = "mean"
    normalize: bool = False
    dense_path: str | Path | None = None
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 512
    trust_remote_code: bool = False
    padding_side: str | None = None

    def __post_init__(self) -> None:
        check_pooling_mode(self.pooling)
        if not isinstance(self.max_length, int) or isinstance(self.max_length, bool) or self.max_length < 1:
            raise EncoderError(f"max_length must be a positive int, got {self.max_length!r}")
        if self.padding_side is not None and self.padding_side not in PADDING_SIDES:
            raise EncoderError(f"padding_side must be one of {PADDING_SIDES} or None, got {self.padding_side!r}")
        for field in ("query_prefix", "passage_prefix"):
            if not isinstance(getattr(self, field), str):
                raise EncoderError(f"{field} must be a string, got {getattr(self, field)!r}")

    def portable_dict(self) -> dict[str, Any]:
        """The config without machine-specific paths (what `Encoder.save` writes)."""
        data = dataclasses.asdict(self)
        data.pop("model_path")
        data["dense"] = data.pop("dense_path") is not None
        return data


@dataclass(frozen=True)
class Pretraining:
    """The users (conversations) of a dataset an encoder was pretrained on, kept in its folder.

    Held-out figures on those users would measure memorisation, not retrieval for a new user:
    `rmm train` and `rmm eval` read this record (as `Encoder.pretrained_on`) and refuse them.
    `heldout` and `validation` are the pretraining run's own other users, for the reader.
    """

    dataset: str
    users: tuple[str, ...]
    heldout: tuple[str, ...] = ()
    validation: tuple[str, ...] = ()
    seed: int | None = None
    heldout_fraction: float | None = None

    def seen(self, dataset: str, users: Sequence[str]) -> list[str]:
        """Those of `users` of `dataset` this encoder was trained on, in the order given."""
        trained = set(self.users) if dataset == self.dataset else set()
        return [u for u in users if u in trained]

    def merged(self, other: Pretraining | None) -> Pretraining:
        """This record plus an earlier one (an encoder pretrained again keeps what it saw before)."""
        if other is None or other.dataset != self.dataset:
            return self  # one dataset per record: a base pretrained elsewhere is not comparable by user id
        users = tuple(dict.fromkeys((*other.users, *self.users)))
        return dataclasses.replace(self, users=users, heldout=tuple(u for u in self.heldout if u not in users))

    def to_json(self) -> dict[str, Any]:
        return {"format": PRETRAINING_FORMAT, **dataclasses.asdict(self)}


def read_pretraining(folder: str | Path) -> Pretraining | None:
    """The folder's pretraining record, or None when it has none (a preset, any HF folder)."""
    file = Path(folder).expanduser() / PRETRAINING_FILE
    if not file.is_file():
        return None
    data = _read_format_json(file, PRETRAINING_FORMAT, "an rmm pretraining record")
    try:
        return Pretraining(dataset=str(data["dataset"]), users=tuple(map(str, data["users"])),
                           heldout=tuple(map(str, data.get("heldout", ()))),
                           validation=tuple(map(str, data.get("validation", ()))),
                           seed=data.get("seed"), heldout_fraction=data.get("heldout_fraction"))
    except (KeyError, TypeError) as err:
        raise CorruptFileError(f"{file} lacks a field or has one of the wrong type: {err}") from err


class DenseHead(nn.Module):
    """sentence-transformers' `Dense` module: `activation(linear(x))`, same file layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation_function: str = "torch.nn.modules.linear.Identity") -> None:
        super().__init__()
        activation_function = _ACTIVATION_ALIASES.get(activation_function.lower(), activation_function)
        if activation_function not in _ACTIVATIONS:
            raise EncoderError(
                f"unsupported dense activation {activation_function!r}; supported: {sorted(_ACTIVATIONS)}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.activation_function = activation_function
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = _ACTIVATIONS[activation_function]()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.linear(x))

    @classmethod
    def load(cls, folder: str | Path) -> DenseHead:
        folder = Path(folder)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(f"dense head folder {folder} has no config.json")
        try:
            config = json.loads(config_file.read_text())
            head = cls(int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                       config.get("activation_function") or ST_DEFAULT_ACTIVATION)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if isinstance(err, EncoderError):
                raise
            raise CorruptFileError(f"cannot read dense head config {config_file}: {err}") from err
        state = _load_dense_state(folder)
        # Stella's 2_Dense_* files hold `linear.weight`; tolerate a bare `weight` too
        state = {key if key.startswith("linear.") else f"linear.{key}": value for key, value in state.items()}
        try:
            head.load_state_dict(state)
        except RuntimeError as err:
            raise CorruptFileError(f"dense head weights in {folder} do not match its config: {err}") from err
        return head

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"in_features": self.in_features, "out_features": self.out_features,
                  "bias": self.linear.bias is not None, "activation_function": self.activation_function}
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        state = {key: value.detach().cpu().contiguous() for key, value in self.state_dict().items()}
        save_safetensors(state, str(folder / "model.safetensors"))


def _load_dense_state(folder: Path) -> dict[str, Tensor]:
    safetensors_file = folder / "model.safetensors"
    bin_file = folder / "pytorch_model.bin"
    try:
        if safetensors_file.is_file():
            return load_safetensors(str(safetensors_file))
        if bin_file.is_file():
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch raise assorted types on bad files
        raise CorruptFileError(f"cannot read dense head weights in {folder}: {err}") from err
    raise ModelNotFoundError(f"dense head folder {folder} has neither model.safetensors nor pytorch_model.bin")


def _rounded_sample(tensor: Tensor, count: int = 32) -> bytes:
    """A few values of a parameter (start of its first row, end of its last), rounded to bf16 so a
    CPU fp32 copy and a CUDA bf16 copy of the same weights give the same bytes."""
    values = tensor.detach()
    rows = values.reshape(1, -1) if values.dim() <= 1 else values.reshape(values.shape[0], -1)
    sample = torch.cat([rows[0, :count], rows[-1, -count:]]).float().to(torch.bfloat16)
    return sample.view(torch.int16).cpu().numpy().tobytes()


class OneDnnLinear(nn.Linear):
    """`nn.Linear` whose CPU float32 inference runs oneDNN's GEMM instead of the BLAS one.

    Same fp32 arithmetic (results agree to rounding, ~1e-6), but on CPUs where MKL's sgemm is not
    tuned (AMD EPYC here) oneDNN is ~1.5-2x faster, and linear layers are most of an encoder's
    time. Anything else — autograd, CUDA, half precision — takes the ordinary path, so training
    code that reuses `Encoder.model` is unaffected.
    """

    def forward(self, input: Tensor) -> Tensor:
        if (not torch.is_grad_enabled() and input.device.type == "cpu" and input.dtype == torch.float32
                and self.weight.dtype == torch.float32):
            return torch.ops.mkldnn._linear_pointwise(input, self.weight, self.bias, "none", [], "")
        return super().forward(input)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear op and it matches `F.linear` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(3, 5, 16, generator=generator)
        weight = torch.randn(8, 16, generator=generator)
        bias = torch.randn(8, generator=generator)
        with torch.inference_mode():
            fast = torch.ops.mkldnn._linear_pointwise(probe, weight, bias, "none", [], "")
            return bool(torch.allclose(fast, nn.functional.linear(probe, weight, bias), atol=1e-4, rtol=1e-4))
    except (RuntimeError, NotImplementedError):
        return False


def use_onednn_linears(model: nn.Module) -> int:
    """Switch the plain `nn.Linear` layers of `model` to `OneDnnLinear` in place (same parameters,
    same state_dict); returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            switched += 1
    return switched


def _is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


class Encoder:
    """Encodes queries and passages to float32 CPU tensors, in batches sorted by token length.

    `onednn` (an addition to the contract's arguments; None = on for CPU float32) runs the model's
    linear layers through oneDNN at inference, see `OneDnnLinear`. `max_batch_tokens` caps a
    batch's padded size as well as `batch_size` its texts (None = `CPU_BATCH_TOKENS` on a CPU, no
    cap elsewhere). `passage_cache` (a `PassageCache`, off by default) answers queries and passages
    whose token ids (prefix included) it has seen; identical token sequences within one call are
    always encoded once. `cuda_graphs` (CUDA only) replays each batch's forward from a CUDA graph
    (`rmm.encoders.cuda_graphs`), batches padded to a few shapes: the host's launch cost, not the
    GPU, bounds short texts.
    """

    # whose data the weights were pretrained on (`load_encoder` reads it from the folder; None: unknown)
    pretrained_on: Pretraining | None = None

    def __init__(self, config: EncoderConfig, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", batch_size: int = 64, show_progress: bool | None = None,
                 onednn: bool | None = None, max_batch_tokens: int | None = None, cuda_graphs: bool = False) -> None:
        if batch_size < 1:
            raise EncoderError(f"batch_size must be >= 1, got {batch_size}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise EncoderError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.config = config
        self.name = config.name
        self.batch_size = batch_size
        self.passage_cache: PassageCache | None = None
        self.show_progress = show_progress
        self.device = resolve_device(device)
        self.dtype = default_dtype(self.device, dtype)
        self.max_batch_tokens = max_batch_tokens or (CPU_BATCH_TOKENS if self.device.type == "cpu" else None)
        model_path = Path(config.model_path).expanduser()
        if not _is_model_folder(model_path):
            raise ModelNotFoundError(
                f"encoder {config.name!r}: no Hugging Face model folder (with config.json) at {model_path}. "
                "Weights are never downloaded at run time: fetch them on a machine with internet "
                "(e.g. `huggingface-cli download facebook/contriever --local-dir ./contriever`) "
                "and pass that folder."
            )
        self.tokenizer, self.model = self._load_transformer(model_path)
        if onednn is None:
            onednn = self.device.type == "cpu" and self.dtype == torch.float32
        if onednn and onednn_linear_available():
            logger.debug("oneDNN linears on %d layers of %s", use_onednn_linears(self.model), config.name)
        self.padding_side = config.padding_side or ("left" if config.pooling == "last"
                                                    else getattr(self.tokenizer, "padding_side", "right"))
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:  # decoder tokenizers often have no pad token; masked anyway
            pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_token_id = int(pad_id)
        self.max_length = self._usable_max_length()
        self._forward_params = set(inspect.signature(self.model.forward).parameters)
        self._wants_use_cache = "use_cache" in self._forward_params
        self.dense: DenseHead | None = None
        if config.dense_path is not None:
            self.dense = DenseHead.load(Path(config.dense_path).expanduser()).to(self.device).eval()
            hidden = getattr(self.model.config, "hidden_size", None)
            if hidden is not None and hidden != self.dense.in_features:
                raise EncoderError(
                    f"dense head at {config.dense_path} expects {self.dense.in_features} inputs but the "
                    f"model's hidden size is {hidden}"
                )
        self.dim = self.dense.out_features if self.dense is not None else int(self.model.config.hidden_size)
        self.fingerprint = self._compute_fingerprint()
        self.graphs: InferenceGraphs | None = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise EncoderError(f"cuda_graphs needs a CUDA device; this encoder is on {self.device}")
            self.graphs = InferenceGraphs(self.collate, self.embed, max_rows=batch_size, max_length=self.max_length)

    # ---------------------------------------------------------------- loading

    def _load_transformer(self, model_path: Path) -> tuple[Any, nn.Module]:
        from transformers import AutoModel, AutoTokenizer

        trust = self.config.trust_remote_code
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust)
        except (OSError, ValueError) as err:
            raise ModelNotFoundError(f"encoder {self.config.name!r}: cannot load a tokenizer from {model_path}: {err}") from err
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust, "dtype": self.dtype}
        try:
            try:
                model = AutoModel.from_pretrained(model_path, attn_implementation="sdpa", **kwargs)
            except (ValueError, ImportError, TypeError):
                # remote-code or exotic architectures without an SDPA path keep their own attention
                model = AutoModel.from_pretrained(model_path, **kwargs)
        except OSError as err:
            raise ModelNotFoundError(f"encoder {self.config.name!r}: no usable weights in {model_path}: {err}") from err
        model.to(self.device).eval()
        model.requires_grad_(False)
        return tokenizer, model

    def _usable_max_length(self) -> int:
        """config.max_length, capped where the model has no position beyond (long inputs would crash)."""
        limits = [self.config.max_length]
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(model_max, int) and 0 < model_max < 1_000_000:
            limits.append(model_max)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            limits.append(positions)
        if min(limits) < self.config.max_length:
            logger.info("encoder %s: max_length %d capped to %d by the model", self.name,
                        self.config.max_length, min(limits))
        return min(limits)

    def _compute_fingerprint(self) -> str:
        """Identity of the passage-embedding function: weights (sampled), pooling, head, norm, prefix.

        Paths and the preset name are left out on purpose, so a copy written by `save` (or the
        same folder reached by another name) keeps the fingerprint; the query prefix is left out
        because stored passage vectors do not depend on it.
        """
        digest = hashlib.sha256()
        recipe = {"pooling": self.config.pooling, "normalize": self.config.normalize,
                  "passage_prefix": self.config.passage_prefix, "max_length": self.config.max_length,
                  "dim": self.dim}
        digest.update(json.dumps(recipe, sort_keys=True).encode())
        modules: list[nn.Module] = [self.model] + ([self.dense] if self.dense is not None else [])
        for module in modules:
            for parameter in module.parameters():
                digest.update(str(tuple(parameter.shape)).encode())
                digest.update(_rounded_sample(parameter))
        if self.dense is not None:
            digest.update(self.dense.activation_function.encode())
        model_type = getattr(self.model.config, "model_type", "model")
        parts = [model_type, f"d{self.dim}", self.config.pooling]
        if self.dense is not None:
            parts.append("dense")
        if self.config.normalize:
            parts.append("l2")
        return "-".join(parts) + ":" + digest.hexdigest()[:16]

    # ---------------------------------------------------------------- encoding

    def encode_queries(self, texts: Sequence[str]) -> Tensor:
        return self._encode(texts, self.config.query_prefix, self.passage_cache)

    def encode_passages(self, texts: Sequence[str]) -> Tensor:
        return self._encode(texts, self.config.passage_prefix, self.passage_cache)

    def tokenize(self, texts: Sequence[str], prefix: str = "") -> list[list[int]]:
        """Token ids per text (prefix added, truncated to max_length), unpadded."""
        _check_texts(texts)
        prefixed = [prefix + text for text in texts] if prefix else list(texts)
        encoded = self.tokenizer(prefixed, truncation=True, max_length=self.max_length, padding=False,
                                 return_attention_mask=False, return_token_type_ids=False)
        # a tokenizer that adds no special tokens turns "" into no tokens at all; give it one
        return [ids if ids else [self.pad_token_id] for ids in encoded["input_ids"]]

    def collate(self, sequences: Sequence[Sequence[int]], length: int | None = None) -> dict[str, Tensor]:
        """Pad token-id lists into model inputs on this encoder's device (its padding side), to the
        longest of them or to `length` when that is longer (fixed shapes for CUDA graphs)."""
        longest = max(max(len(seq) for seq in sequences), length or 0)
        pad = self.pad_token_id
        if self.padding_side == "left":
            ids = [[pad] * (longest - len(seq)) + list(seq) for seq in sequences]
            mask = [[0] * (longest - len(seq)) + [1] * len(seq) for seq in sequences]
        else:
            ids = [list(seq) + [pad] * (longest - len(seq)) for seq in sequences]
            mask = [[1] * len(seq) + [0] * (longest - len(seq)) for seq in sequences]
        inputs = {"input_ids": torch.tensor(ids, dtype=torch.long),
                  "attention_mask": torch.tensor(mask, dtype=torch.long)}
        if self.padding_side == "left" and "position_ids" in self._forward_params:
            # positions count real tokens only, so a left-padded text sees the positions it would alone
            inputs["position_ids"] = (inputs["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
        if self.device.type != "cuda":
            return inputs
        # page-locked host memory makes the copy truly asynchronous: the next batch is padded on
        # the CPU while this one still runs on the GPU
        return {key: value.pin_memory().to(self.device, non_blocking=True) for key, value in inputs.items()}

    def embed(self, inputs: dict[str, Tensor]) -> Tensor:
        """Model inputs → sentence embeddings on the device, float32; differentiable (training uses it)."""
        if self._wants_use_cache:  # decoder backbones (GTE, Stella) would otherwise return a KV cache
            inputs = {**inputs, "use_cache": False}
        outputs = self.model(**inputs)
        hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
        return self.sentence_embeddings(hidden, inputs["attention_mask"])

    def sentence_embeddings(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """The transformer's last hidden states [B, T, H] → pooled, dense head, normalised."""
        pooled = pool(hidden, attention_mask, self.config.pooling)
        if self.dense is not None:
            pooled = self.dense(pooled)
        if self.config.normalize:
            pooled = nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled

    def _progress_enabled(self, count: int) -> bool:
        if self.show_progress is not None:
            return self.show_progress
        return count > PROGRESS_THRESHOLD and logger.isEnabledFor(logging.INFO)

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Positions grouped into batches, longest first, each within `batch_size` texts and
        `max_batch_tokens` padded tokens (a longer text alone); padding goes to the batch's longest."""
        # longest first: a batch that does not fit in memory fails at once, not at the end
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        limit = self.max_batch_tokens
        out: list[list[int]] = []
        for i in order:
            batch = out[-1] if out else None
            if (batch is None or len(batch) >= self.batch_size
                    or (limit is not None and (len(batch) + 1) * lengths[batch[0]] > limit)):
                out.append([i])
            else:
                batch.append(i)
        return out

    @torch.inference_mode()
    def _encode(self, texts: Sequence[str], prefix: str, cache: PassageCache | None = None) -> Tensor:
        if len(texts) == 0:
            _check_texts(texts)
            return torch.empty(0, self.dim, dtype=torch.float32)
        sequences = self.tokenize(texts, prefix)
        keys = [token_key(seq) for seq in sequences]
        known = cache.get(keys) if cache is not None else {}
        # each distinct token sequence the cache lacks is run once
        todo = list(dict.fromkeys(key for key in keys if key not in known))
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        unique = [sequences[first[key]] for key in todo]
        progress = None
        if self._progress_enabled(len(texts)):
            from tqdm.auto import tqdm

            progress = tqdm(total=len(unique), desc=f"encoding ({self.name})", unit="text")
        batches = self.batches([len(seq) for seq in unique])
        chunks: list[Tensor] = []  # kept on the device until the end: no sync per batch on a GPU
        try:
            for batch in batches:
                sequences = [unique[i] for i in batch]
                chunks.append(self.graphs(sequences) if self.graphs is not None else self.embed(self.collate(sequences)))
                if progress is not None:
                    progress.update(len(batch))
        finally:
            if progress is not None:
                progress.close()
        computed = torch.empty(len(unique), self.dim, dtype=torch.float32)
        if chunks:
            computed[torch.tensor([i for batch in batches for i in batch], dtype=torch.long)] = \
                torch.cat(chunks).float().cpu()
        if cache is not None and todo:
            cache.put(todo, computed)
        rows = {key: computed[j] for j, key in enumerate(todo)} | known
        return torch.stack([rows[key] for key in keys])

    # ---------------------------------------------------------------- saving

    def save(self, folder: str | Path) -> Path:
        """Write weights, tokenizer and `rmm_encoder.json` (and `rmm_pretraining.json` when the encoder
        has a pretraining record), loadable with `load_encoder(folder)`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if self.dense is not None:
            self.dense.save(folder / DENSE_SUBDIR)
        payload = {"format": RMM_ENCODER_FORMAT, **self.config.portable_dict()}
        (folder / RMM_ENCODER_FILE).write_text(json.dumps(payload, indent=2))
        if self.pretrained_on is not None:  # a copy keeps the record of whose data trained it
            (folder / PRETRAINING_FILE).write_text(json.dumps(self.pretrained_on.to_json(), indent=2))
        return folder

    def __repr__(self) -> str:
        return (f"Encoder(name={self.name!r}, dim={self.dim}, pooling={self.config.pooling!r}, "
                f"normalize={self.config.normalize}, device={self.device}, dtype={self.dtype})")


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise EncoderError("expected a list of texts, got a single string; wrap it in a list")
    for position, text in enumerate(texts):
        if not isinstance(text, str):
            raise EncoderError(f"text {position} is {type(text).__name__}, not str")


def read_rmm_encoder_file(folder: Path) -> dict[str, Any]:
    """The saved config of an rmm encoder folder (fields of EncoderConfig minus paths)."""
    return _read_format_json(folder / RMM_ENCODER_FILE, RMM_ENCODER_FORMAT, "an rmm encoder config")


def _read_format_json(file: Path, version: int, what: str) -> dict[str, Any]:
    """A JSON object file of rmm's that names its `format`; `CorruptFileError` when it is not one."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CorruptFileError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(data, dict) or data.get("format") != version:
        raise CorruptFileError(f"{file} is not {what} of format {version}")
    return data

