-- The server's shared state, version 3: a hybrid first stage (BM25 + dense, `retriever: hybrid`)
-- gives each candidate a lexical feature (its fused score scaled to [0, 1]) that the reranker
-- scores with a learned weight. A selection keeps it as scored (float32 bytes, K) so the learner
-- rebuilds the update from the row alone. NULL for dense candidates and for rows written before
-- this column: those rebuild without the feature, as they were scored.
ALTER TABLE selections ADD COLUMN lexical BYTEA;
