"""Data: corpora to token shards offline (``prepare/``), shards to per-rank batches at training
time (``manifest``, ``tokenizer``, ``loader``, which never import ``prepare/``)."""
