-- The server's shared state, version 4: a hybrid first stage may give each candidate further
-- features besides the lexical one (ranks, scores, length, query overlap: `Candidates.features`),
-- which the reranker weighs. A selection keeps them as scored — float32 bytes, K x F, row-major —
-- with their F names in order (a JSON array), so the learner rebuilds the update from the row
-- alone, whatever the code computes by then. NULL in both for dense candidates and for rows
-- written before these columns: those rebuild without features, as they were scored.
ALTER TABLE selections ADD COLUMN features BYTEA;
ALTER TABLE selections ADD COLUMN feature_names JSONB;
