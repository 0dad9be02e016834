"""The memory: per-user store, vector index and bank, lexical BM25, open sessions."""
