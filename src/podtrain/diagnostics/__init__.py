"""Diagnostics launched like training: how healthy the cluster is before a long run.

* ``collectives``: ``podtrain bench collectives`` (the run over ops, sizes and groups, the
  records, the table, the CLI), built on ``busbw`` (the nccl-tests arithmetic, message sizes,
  groups and the check pattern) and ``cases`` (one collective's buffers, check and timing);
* ``doctor``: ``podtrain doctor`` (each rank's facts and probes, the report, the CLI), whose pure
  verdicts over the gathered facts are in ``checks``.
"""
