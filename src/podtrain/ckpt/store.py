"""The checkpoint's I/O seam: every checkpoint file is read and written through a ``podtrain.storage``
store (a POSIX directory today; ``s3://`` and a node-local tier are other stores with the same
methods). Nothing in ``podtrain.ckpt`` touches the file system except through one.

Checkpoints use: ``list_dirs``, ``list`` (with a trailing ``/`` for one checkpoint's files),
``exists`` (files), ``read_bytes``, ``read_range``, ``read_into``, ``open_write`` (atomic: visible
only once committed), ``write_bytes``, ``delete``, ``delete_prefix`` and ``local_path``.
"""

from __future__ import annotations

from podtrain.storage import NotFound, StorageError, open_store

__all__ = ["NotFound", "StorageError", "open_store"]
