-- The memory bank, version 1: memories with their embeddings, users with generation counters,
-- and a key/value meta table (store id, encoder record, embedding dimension).
--
-- pgvector's `vector` type is installed once per database, in schema public, so that every bank
-- schema resolves it. Creating the extension needs a superuser; where it already exists this
-- statement is a no-op that needs no rights.
CREATE EXTENSION IF NOT EXISTS vector SCHEMA public;

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

INSERT INTO meta (key, value) VALUES
    ('store_id', replace(gen_random_uuid()::text, '-', '')),
    ('created_at', extract(epoch FROM clock_timestamp())::text);

-- A user's generation is bumped by one in every write transaction that touches their memories
-- and survives delete_user (active = false), so a number is never reused for other contents.
CREATE TABLE users (
    user_id    TEXT PRIMARY KEY,
    generation BIGINT NOT NULL,
    active     BOOLEAN NOT NULL
);

-- One row per memory; `embedding` is NULL for a memory stored without one. The column gets the
-- bank's dimension (vector(d)) and an HNSW index with the first embedding written, since the
-- dimension comes from the encoder, not from this file.
CREATE TABLE memories (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id     TEXT NOT NULL,
    id          TEXT NOT NULL,
    kind        TEXT NOT NULL,
    text        TEXT NOT NULL,
    refs        JSONB NOT NULL,
    source_text TEXT NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL,
    updated_at  DOUBLE PRECISION NOT NULL,
    merged_from JSONB NOT NULL,
    time_span   JSONB,
    embedding   vector,
    UNIQUE (user_id, id)
);

CREATE INDEX memories_user_seq ON memories (user_id, seq);
