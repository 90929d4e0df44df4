"""Checkpoints: one layout for every strategy and world size, written by every rank in the
background, verified as each rank reads its share; auto-resume with a collective fallback.

Each module has one job (import them directly; this package re-exports nothing):

* ``checkpointer``: ``Checkpointer`` (restore -> ``ResumeState``, save, failed, wait, close).
* ``plan``: who writes and who reads which flat ranges (pure), block CRC-32s.
* ``statedict``: the state by parameter name through torch's public state-dict API.
* ``writer``: the background writer thread, each rank's piece file, rank 0's manifest and ``latest``.
* ``load``: each rank reads and verifies its share, then the ranks exchange the rest.
* ``staging`` + ``host_buffers``: bounded host staging, side-stream device-to-host copies.
* ``store``: the I/O seam (``podtrain.storage``: a directory today, other tiers later).
* ``reader``: offline reads (``sample``, ``export``, ``verify``); ``layout``: names, manifest, choice,
  retention; ``tensorio``: the piece file format; ``state``: plain-JSON encoding; ``interval``:
  ``ckpt.every=auto``.
"""
