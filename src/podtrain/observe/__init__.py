"""Observing a run: what the hardware can do, what the run did, and how it is shown.

* ``hardware``: peak FLOP/s for MFU (GPU table or a CPU matmul measurement), the matmul timer the
  doctor shares, peak and total memory per rank;
* ``metrics``: ``MetricsWriter``, the durable RUN_DIR/metrics.jsonl;
* ``console``: rank 0's progress bar or log lines, the one-line record summary, logging setup.
"""
