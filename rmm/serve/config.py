"""The server's settings: one dataclass tree, read from YAML, overridable from the command line.

Every value is checked when the config is built (reading and typing are `rmm.config`'s, shared by
every command; the ranges are the fields' pydantic constraints here, the rules spanning several fields
`ServeConfig.validate`), so a typo in `serve.yaml` stops the server at start-up with a
message naming the key, never as a confusing failure under load. API keys may
live in the YAML, in an environment variable or in a key file, so that secrets need not sit in a
file that is committed next to the rest of the configuration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from rmm import config as _config
from rmm.errors import ConfigError
from rmm.memory.hybrid import OVER_DENSE, Fusion
from rmm.policy.learner import LearnerConfig, recipe_config
from rmm.encoders.query.precision import QUERY_PRECISIONS

__all__ = [
    "DEFAULT_KEYS_ENV",
    "RETRIEVER_FUSIONS",
    "AuthConfig",
    "BatchingConfig",
    "ConfigError",
    "LimitsConfig",
    "ServeConfig",
    "ShadowConfig",
    "load_config",
]

DEFAULT_KEYS_ENV = "RMM_API_KEYS"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MIN_KEY_LENGTH = 8
# `retriever:` → the rmm.memory.hybrid fusion over the bank (None: the bank's own dense search)
RETRIEVER_FUSIONS: dict[str, Fusion | None] = {"dense": None, **OVER_DENSE}
# Ranges are the fields' types: pydantic checks them as `load_config` builds the config, and its error
# names the key and the bound ("limits.max_k must be >= 1, got 0 (in serve.yaml)"). What spans
# several fields is `ServeConfig.validate`'s.
_AtLeastOne = Annotated[int, Field(ge=1)]
_AboveZero = Annotated[float, Field(gt=0)]
_NotNegative = Annotated[float, Field(ge=0)]


@dataclass
class BatchingConfig:
    """Dynamic micro-batching of retrieve queries (coalesced across concurrent requests)."""

    enabled: bool = True
    max_batch: _AtLeastOne = 64  # queries per batched call
    max_wait_ms: _NotNegative = 5.0  # how long the first query of a batch may wait for company


@dataclass
class AuthConfig:
    """API keys → tenants. `keys` maps a key to its tenant; more come from `keys_env` and `key_file`.

    The environment variable holds `KEY=TENANT` pairs separated by commas; the key file holds one
    `KEY TENANT` pair per line (blank lines and `#` comments ignored).
    """

    keys: dict[str, str] = field(default_factory=dict)
    keys_env: str = DEFAULT_KEYS_ENV
    key_file: str | None = None

    def resolve(self, environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
        """Every configured key → tenant, from all three sources; clear errors on bad entries."""
        environ = os.environ if environ is None else environ
        out: dict[str, str] = {}

        def put(key: str, tenant: str, where: str) -> None:
            key, tenant = key.strip(), tenant.strip()
            if len(key) < _MIN_KEY_LENGTH:
                raise ConfigError(f"{where}: API keys must have at least {_MIN_KEY_LENGTH} characters")
            if not _TENANT.match(tenant):
                raise ConfigError(
                    f"{where}: tenant {tenant!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
                )
            if key in out and out[key] != tenant:
                raise ConfigError(f"{where}: one API key is given to two tenants ({out[key]!r} and {tenant!r})")
            out[key] = tenant

        for key, tenant in self.keys.items():
            put(str(key), str(tenant), "auth.keys")
        raw = environ.get(self.keys_env, "") if self.keys_env else ""
        for n, pair in enumerate(p for p in raw.split(",") if p.strip()):
            key, sep, tenant = pair.partition("=")
            if not sep:
                raise ConfigError(f"${self.keys_env} entry {n + 1} is not KEY=TENANT")
            put(key, tenant, f"${self.keys_env} entry {n + 1}")
        if self.key_file:
            path = Path(self.key_file).expanduser()
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ConfigError(f"auth.key_file {path} cannot be read: {exc}") from exc
            for n, line in enumerate(lines, start=1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ConfigError(f"{path}:{n}: expected 'KEY TENANT', got {len(parts)} fields")
                put(parts[0], parts[1], f"{path}:{n}")
        return out


@dataclass
class LimitsConfig:
    max_request_bytes: _AtLeastOne = 1 << 20
    max_queries: _AtLeastOne = 256  # queries per retrieve request
    max_memories: _AtLeastOne = 1000  # memories or turns per write request
    max_k: _AtLeastOne = 200
    max_text_chars: _AtLeastOne = 20_000


@dataclass
class ShadowConfig:
    """Shadow scoring and guarded promotion (`rmm.serve.shadow`): candidate weights judged off-policy on
    the serving policy's rewarded, sampled selections, promoted only on sufficient evidence."""

    checkpoint: str = ""  # a reranker checkpoint folder; "": no shadow
    key: str | None = None  # the reranker key judged (a tenant, a user); None: the bank's (reranker_per: bank)
    estimator: Literal["dr", "snips", "ips", "ips-clipped"] = "dr"
    min_selections: _AtLeastOne = 200  # rewarded sampled selections before any decision
    min_ess: _AboveZero = 50.0  # effective sample size (shown memories) of the estimator before any decision
    margin: _NotNegative = 0.0  # reward per shown memory the lower bound must clear the live value by
    level: Annotated[float, Field(gt=0, lt=1)] = 0.95  # the interval's level
    window: _AtLeastOne = 5000  # the newest rewarded selections kept for the estimate
    bootstrap: _AtLeastOne = 500  # bootstrap resamples of the interval
    admin_tenants: list[str] = field(default_factory=list)  # tenants whose keys may read /v1/ope and promote


@dataclass
class ServeConfig:
    """Everything `rmm serve` needs; `configs/serve.yaml` documents each field."""

    bank: str = ""
    store: str = ""  # "": memories in the bank folder (SQLite); postgresql://…: in that database (pgvector)
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    encoder: str = "minilm"
    index_backend: str = "torch"
    # float32 | bfloat16 | float16 | int8 | int4 (the last two CPU only) | auto: what the torch index scans (a
    # shortlist is re-scored in float32); measured at the first search (rmm.memory.scan_choice): auto scans the
    # fastest, a precision slower than float32 here scans float32
    index_precision: str = "float32"
    device: str = "auto"
    torch_threads: _AtLeastOne | None = None  # intra-op CPU threads (None: torch's default, one per core)
    # auto (the fastest engine measured here: rmm.encoders.query.choice) | one of QUERY_ENGINES (obeyed)
    query_precision: str = "auto"
    # auto | on | off: queries encoded in a child process (rmm.encoders.query.process); auto = on when the
    # server loads its encoder itself (`encoder:`) onto the CPU
    query_process: Literal["auto", "on", "off"] = "auto"
    k: _AtLeastOne = 20
    m: _AtLeastOne = 5  # at most k
    tau: _AboveZero | None = None  # None: the recipe's (see `recipe`)
    recipe: str = "auto"  # learner hyper-parameters: auto | paper | normalized (rmm.policy.learner.RECIPES)
    explore: bool = True
    scope: Literal["topk", "bank"] = "topk"
    # dense: the encoder's bank search | hybrid: BM25 over the bank's memories fused with it |
    # bm25: BM25's ranking alone over the bank's memories (rmm.memory.hybrid); hybrid and bm25
    # candidates carry the bank's embeddings and give the reranker its lexical feature
    retriever: Literal["dense", "hybrid", "bm25"] = "dense"
    # hybrid and bm25 candidates also carry `rmm.memory.features.CANDIDATE_FEATURES` (ranks, scores,
    # length, query overlap; logged with each selection), weighed by the reranker with learned weights
    # starting at 0 (LearnerConfig.candidate_features). Dense computes none: its rerankers keep the
    # zero weights, so a bank's checkpoints load under every retriever. Off: Eq. 1 + the lexical feature.
    candidate_features: bool = True
    # whose feedback trains the reranker that ranks whose memories: each tenant learns alone by
    # default; "bank" (one reranker every tenant trains and is ranked by) only by explicit choice
    reranker_per: Literal["bank", "tenant", "user"] = "tenant"
    learner: dict[str, Any] = field(default_factory=dict)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    selection_ttl_s: _AboveZero = 3600.0
    checkpoint_interval_s: _NotNegative = 300.0  # 0: only on shutdown
    # with a postgresql:// store: how often a replica that is not the learner loads newer reranker
    # versions (the bound on how stale its ranking is; at most 2 s)
    reload_interval_s: Annotated[float, Field(gt=0, le=2.0)] = 1.0
    # with a postgresql:// store: how long a replica holds a claimed reflection job before another
    # may take it over (renewed every third of it while the job runs)
    job_lease_s: _AboveZero = 60.0
    # with a postgresql:// store: the database's search and pool settings (rmm.memory.bank.DATABASE_OPTIONS:
    # exact_limit, ef_search, pool_min, pool_max, pool_timeout_s; PostgresStore's defaults when absent)
    database: dict[str, Any] = field(default_factory=dict)
    llm: str | None = None
    reflection_speakers_exclude: list[str] = field(default_factory=lambda: ["assistant"])
    # each ended session also gets an `events` job adding it to the user's CompassMem event graph
    # (rmm.serve.event_jobs: the LLM builder with `llm`, else the labelled non-LLM fallback)
    reflection_events: bool = False
    # each reflection (and events) job keeps the user's Semantic XPath bank tree current
    # (rmm.reflection.xpath_tree.BankTree: User -> Session -> Topic/Event/Turn -> Turn); off: the
    # tree is the client's own (built through /v1/users/{user}/tree/nodes)
    reflection_tree: bool = False
    seed: int = 0
    log_level: str = "info"

    @property
    def first_stage_fusion(self) -> Fusion | None:
        """How BM25 enters the first stage (`RETRIEVER_FUSIONS`); None for the dense search alone."""
        return RETRIEVER_FUSIONS[self.retriever]

    def validate(self) -> ServeConfig:
        """The rules that span fields (a field's own range is its type's, checked by `load_config`)."""
        if not self.bank:
            raise ConfigError("bank: a bank folder is required (rmm serve --bank PATH, or `bank:` in the config)")
        if self.store:
            from rmm.memory.storage import is_database_url

            if not is_database_url(self.store):
                raise ConfigError(f"store must be a postgresql:// URL (or empty for the bank folder), got {self.store!r}")
        if self.query_precision not in QUERY_PRECISIONS:
            raise ConfigError(f"query_precision must be one of {list(QUERY_PRECISIONS)}, got {self.query_precision!r}")
        if self.m > self.k:
            raise ConfigError(f"need 1 <= m <= k, got k={self.k}, m={self.m}")
        if self.scope == "bank" and self.retriever == "bm25":
            raise ConfigError("scope: bank searches the whole bank with the learned query vector, which "
                              "retriever: bm25 (a text ranking) cannot use: pick scope: topk or retriever: dense|hybrid")
        from rmm.memory.index import BACKENDS, CPU_PRECISIONS, INDEX_PRECISIONS

        if self.index_backend not in BACKENDS:
            raise ConfigError(f"index_backend {self.index_backend!r} is not one of {list(BACKENDS)}")
        if self.index_precision not in INDEX_PRECISIONS:
            raise ConfigError(f"index_precision {self.index_precision!r} is not one of {list(INDEX_PRECISIONS)}")
        if self.index_precision != "float32" and (self.index_backend != "torch" or self.store):
            raise ConfigError(f"index_precision {self.index_precision!r} is for the torch index of a bank folder "
                              f"(index_backend is {self.index_backend!r}{', store is a database' if self.store else ''})")
        cpu_scan = self.index_precision in CPU_PRECISIONS
        if cpu_scan or self.query_process == "on":  # settings that only work on the CPU
            from rmm.device import resolve_device

            on_cpu = resolve_device(self.device).type == "cpu"
            if cpu_scan and not on_cpu:
                raise ConfigError(f"index_precision {self.index_precision!r} scans on the CPU; device {self.device!r} "
                                  "is not one (use float16 or bfloat16 there)")
            if self.query_process == "on" and not on_cpu:
                raise ConfigError(f"query_process: on encodes queries in a CPU process; device {self.device!r} is "
                                  "not the CPU (use auto or off there)")
        if self.database:
            from rmm.memory.bank import DATABASE_OPTIONS

            if not self.store:
                raise ConfigError("database: settings for a postgresql:// store, but `store` is empty (a bank folder)")
            unknown = sorted(set(self.database) - set(DATABASE_OPTIONS))
            if unknown:
                raise ConfigError(f"database: unknown key(s) {unknown}; known: {list(DATABASE_OPTIONS)}")
        if self.k > self.limits.max_k:
            raise ConfigError(f"k={self.k} exceeds limits.max_k={self.limits.max_k}")
        if self.shadow.checkpoint and self.shadow.key is None and self.reranker_per != "bank":
            raise ConfigError(f"shadow.key: name the reranker key the shadow is judged on (a tenant with "
                              f"reranker_per: {self.reranker_per}); only reranker_per: bank has one to default to")
        self.learner_config()  # raises ConfigError on a bad learner section
        return self

    def learner_config(self, normalized_encoder: bool = False) -> LearnerConfig:
        """The recipe's settings for this encoder (`auto`: sharper τ for L2-normalised ones), then
        `tau`, `candidate_features` and the `learner` section on top."""
        known = {f.name for f in dataclasses.fields(LearnerConfig)}
        unknown = sorted(set(self.learner) - known)
        if unknown:
            raise ConfigError(f"learner: unknown key(s) {unknown}; known: {sorted(known)}")
        if "candidate_features" in self.learner:  # one key decides both the first stage and the reranker
            raise ConfigError("learner.candidate_features: set `candidate_features` at the top level instead (it "
                              "decides what the first stage computes and what the reranker weighs)")
        try:
            return recipe_config(self.recipe, normalized_encoder,
                                 **{"tau": self.tau, "candidate_features": self.candidate_features, **self.learner})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"learner: {exc}") from exc

    @property
    def index_options(self) -> dict[str, Any]:
        """What the bank passes to its indexes (empty at float32, so existing index files stay valid), or
        to its PostgreSQL store (the `database` section)."""
        if self.store:
            return dict(self.database)
        return {} if self.index_precision == "float32" else {"precision": self.index_precision}

    @property
    def bank_path(self) -> Path:
        return Path(self.bank).expanduser()


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: typing.Mapping[str, str] | None = None) -> ServeConfig:
    """The YAML file's settings (if any), then `overrides` (dotted keys, e.g. `batching.max_batch`).

    `None` values in `overrides` are skipped, so argparse defaults of None leave the file's value.
    """
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    config = _config.load_config(ServeConfig, path, given, label="server config")
    config.validate()
    config.auth.resolve(environ)  # fail at start-up on a bad key source, not at the first request
    return config


def key_digest(key: str) -> str:
    """Keys are looked up by digest, so the lookup's timing says nothing about stored keys."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def valid_tenant(name: str) -> bool:
    return bool(_TENANT.match(name))
