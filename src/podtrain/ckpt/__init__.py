"""Checkpoints: atomic, checksummed, pickle-free, written in the background; auto-resume.

Each module has one job (import them directly; this package re-exports nothing):

* ``checkpointer``: ``Checkpointer``, what the training loop uses: restore (rank 0 decides, every
  rank loads), ``should_save``, ``save`` (host snapshot, then background write), ``wait``, ``close``.
* ``writer``: the background writer thread and the write paths (rank-0 safetensors, DCP shards),
  the manifest, the rename into place, ``latest`` and retention.
* ``host_buffers``: reused (pinned on GPUs) host copies of the tensors a save writes.
* ``reader``: reading a checkpoint without a process group (``sample``, ``export``): ``load_latest``,
  ``load_latest_weights``, ``run_config_of``, ``build_model_from_checkpoint``.
* ``tensorio``: write a safetensors file in one pass that also computes its SHA-256.
* ``state``: optimizer / RNG / train state <-> JSON plus named tensors (nothing is pickled).
* ``layout``: directory and file names, the manifest, validation, the choice of the newest valid
  checkpoint, retention.
"""
