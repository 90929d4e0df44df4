"""Checkpoint internals: safetensors streaming I/O, plain-data state encoding, on-disk layout.

The public API lives in ``podtrain.checkpoint`` (``Checkpointer``, ``load_latest``,
``load_latest_weights``); these modules are its parts, each small enough to read on its own:

* ``tensorio``: write a safetensors file in one pass that also computes its SHA-256.
* ``state``: optimizer / RNG / train state <-> JSON plus named tensors (nothing is pickled).
* ``layout``: directory names, the manifest, validation and the choice of the newest valid one.
"""
