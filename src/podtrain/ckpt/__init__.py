"""Checkpoints: one layout for every strategy and world size, written by every rank in the
background, verified as each rank reads its share; auto-resume with a collective fallback.

Each module has one job (import them directly; this package re-exports nothing): the table in
docs/architecture.md says which; ``checkpointer.Checkpointer`` is what the training loop uses.
"""
