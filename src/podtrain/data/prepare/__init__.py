"""Offline data preparation (``podtrain prepare``): any corpus -> token shards + ``manifest.json``.

Nothing here is imported at training time; training reads the results through
``podtrain.data.manifest``, ``podtrain.data.tokenizer`` and ``podtrain.data.loader``.

The package, in pipeline order:

- ``cli``: the ``podtrain prepare`` flags, the options they map to, and the summary line.
- ``pipeline``: the options, the run itself (resume, locking, cleanup on error) and the manifest
  it writes last.
- ``replace``: the dataset already at the output, which another recipe must not replace silently.
- ``reuse``: ``--tokenizer DATA_DIR``, the tokenizer of a dataset already prepared.
- ``sources``: INPUTs (files, directories, globs, ``builtin``) to an ordered list of source files
  (text decided by suffix, else by the file's first bytes), and the files skipped, by reason;
  ``compression``: ``.gz``/``.bz2``/``.xz``/``.zst`` read as they stream.
- ``builtin``: the built-in corpus (this interpreter's standard-library sources).
- ``readers``: sources cut into tasks of ~chunk_bytes of raw input (``TextItem``, ``JsonlItem``,
  ``RowsItem``).
- ``encode``: decode, split and tokenize a task, inline or in a pool of worker processes.
- ``shards``: shard writing, the done records a resume trusts, and cleanup.
- ``holdout``: the one validation document a small corpus keeps when none hashes into the split.
- ``progress``: the progress bar.
- ``parts``: one part of a ``--num-parts N`` prepare (and the BPE trained once before the parts);
  ``merge``: ``podtrain prepare merge``, which joins the parts under one manifest.
"""
