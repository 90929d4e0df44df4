"""The checkpoint's I/O seam: every checkpoint file is read and written through a ``podtrain.storage``
store (a POSIX directory today; ``s3://`` and a node-local tier are other stores with the same
methods). Nothing in ``podtrain.ckpt`` touches the file system except through one.

Checkpoints use: ``list_dirs``, ``list`` (with a trailing ``/`` for one checkpoint's files),
``exists`` (files), ``read_bytes``, ``read_range``, ``read_into``, ``open_write`` (atomic: visible
only once committed), ``write_bytes``, ``delete``, ``delete_prefix`` and ``local_path``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from podtrain.storage import NotFound, StorageError, open_store

__all__ = ["NotFound", "StorageError", "open_store", "read_json", "RAISE"]

RAISE: Any = object()  # read_json's ``missing``: a missing file raises ``NotFound`` (a constant, never mutated)


def read_json(store, name: str, data: bytes | None = None, *,
              error: Callable[[str], Exception] | None = ValueError, missing: Any = RAISE) -> dict[str, Any] | None:
    """The small JSON object ``name`` of ``store`` (``data``: its bytes, already read by a range or
    versioned read; ``store`` None: ``name`` is the whole place to name). The one JSON reader of
    ``podtrain.ckpt``; the caller chooses each outcome:

    - not JSON, or JSON but not an object: ``error("<url>/<name> is not a JSON object (cause)")`` is raised
      (an exception class, or a function making one from the message); ``error=None`` returns None;
    - a missing file (``NotFound``, ``FileNotFoundError``): raised, unless ``missing`` is given, which
      is returned. Any other storage failure is raised whatever the caller chose (an outage is never
      "absent" nor "damaged")."""
    where = name if store is None else store.where(name)
    if data is None:
        try:
            data = store.read_bytes(name)
        except (NotFound, FileNotFoundError):
            if missing is RAISE:
                raise
            return missing
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        cause = str(exc)
    else:
        if isinstance(value, dict):
            return value
        cause = f"a {type(value).__name__}, not an object"
    if error is None:
        return None
    raise error(f"{where} is not a JSON object ({cause})")
