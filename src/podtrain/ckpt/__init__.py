"""Checkpoints: atomic, checksummed, pickle-free, written in the background; auto-resume.

Each module has one job (import them directly; this package re-exports nothing):

* ``checkpointer``: ``Checkpointer``, what the training loop uses: restore (rank 0 decides, every
  rank loads), ``should_save``, ``save`` (host snapshot, then background write), ``wait``, ``close``.
* ``writer``: the background writer thread and the write paths (rank-0 safetensors, DCP shards),
  the manifest, the rename into place, ``latest`` and retention.
* ``host_buffers``: the host staging budget (``ckpt.host_staging_mb``) and its pool of reused
  (pinned on GPUs) slabs.
* ``staging``: one save's tensor bytes streamed from the step loop to the writer through the pool.
* ``streamed_load``: resume tensor by tensor, each read straight into its parameter or optimizer
  state tensor.
* ``reader``: reading a checkpoint whole without a process group (``sample``, ``export``):
  ``load_latest``, ``load_latest_weights``, ``run_config_of``, ``build_model_from_checkpoint``.
* ``tensorio``: write a safetensors file in one streaming pass that also computes its SHA-256;
  index a file's tensors and read one straight into its destination.
* ``state``: optimizer / RNG / train state <-> JSON plus named tensors (nothing is pickled).
* ``layout``: directory and file names, the manifest, validation, the choice of the newest valid
  checkpoint, retention.
"""
