"""Data: corpora to token shards (prepare), shards to per-rank batches (loader)."""
