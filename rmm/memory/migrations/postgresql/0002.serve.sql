-- The server's shared state, version 2: what several `rmm serve` replicas over one bank share
-- besides the memories — pending selections, the feedback they received, reflection jobs and the
-- reranker versions the one learner writes.
--
-- Times are seconds since the epoch (double precision), as in the SQLite files they replace.

-- A selection as it was sampled: the candidates and their embeddings as scored (float32 bytes,
-- K x d), the query embedding, the ordered picks, the behaviour log-probabilities (mu), tau, the
-- mask and the weights version (learner step) it was sampled under. The learner rebuilds the
-- update from this row alone.
CREATE TABLE selections (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    user_id      TEXT NOT NULL,
    reranker_key TEXT NOT NULL,
    query        TEXT NOT NULL,
    memory_ids   JSONB NOT NULL,
    chosen       JSONB NOT NULL,
    explore      BOOLEAN NOT NULL,
    query_emb    BYTEA NOT NULL,
    scores       BYTEA NOT NULL,
    logp         BYTEA,
    noise        BYTEA,
    embeddings   BYTEA NOT NULL,
    tau          DOUBLE PRECISION,
    version      BIGINT,
    mask         BYTEA,
    created_at   DOUBLE PRECISION NOT NULL,
    expires_at   DOUBLE PRECISION NOT NULL,
    consumed_at  DOUBLE PRECISION,
    feedback     JSONB
);

CREATE INDEX selections_user ON selections (user_id);
CREATE INDEX selections_expiry ON selections (expires_at);

-- Feedback, appended in the transaction that marks its selection rewarded (committed before the
-- HTTP answer). `learn` is false for feedback that is stored but never learned from (a greedy
-- selection, a reply without a parseable citation). The learner applies rows with learn and no
-- applied_version, in seq order, and sets applied_version in the transaction that writes the
-- reranker version containing them.
CREATE TABLE feedback (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    selection_id    TEXT NOT NULL UNIQUE REFERENCES selections (id) ON DELETE CASCADE,
    reranker_key    TEXT NOT NULL,
    rewards         JSONB,
    learn           BOOLEAN NOT NULL,
    created_at      DOUBLE PRECISION NOT NULL,
    applied_version BIGINT,
    applied_at      DOUBLE PRECISION
);

CREATE INDEX feedback_unapplied ON feedback (seq) WHERE learn AND applied_version IS NULL;

-- Reflection jobs. A replica claims the oldest runnable one with SELECT ... FOR UPDATE SKIP LOCKED
-- and holds it for lease_until; a claimer that dies stops renewing, and the job becomes claimable
-- again once its lease has passed.
CREATE TABLE jobs (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    user_id     TEXT NOT NULL,
    kind        TEXT NOT NULL,
    payload     JSONB NOT NULL,
    status      TEXT NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL,
    started_at  DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    lease_until DOUBLE PRECISION,
    claimed_by  TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    result      JSONB,
    error       TEXT
);

CREATE INDEX jobs_runnable ON jobs (created_at) WHERE status IN ('queued', 'running');
CREATE INDEX jobs_user ON jobs (user_id);

-- Reranker versions: the learner checkpoint (a tar of the checkpoint folder) per learner key,
-- version = the learner's optimizer step, so it is also the weights version stamped on the
-- selections sampled under it. Only the holder of the learner lock writes; the primary key
-- fences off a second writer.
CREATE TABLE reranker_versions (
    reranker_key TEXT NOT NULL,
    version      BIGINT NOT NULL,
    created_at   DOUBLE PRECISION NOT NULL,
    checkpoint   BYTEA NOT NULL,
    PRIMARY KEY (reranker_key, version)
);
