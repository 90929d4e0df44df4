"""Side process groups (checkpoint writers, peer replicas, the stop-signal agreement under NCCL)
whose gloo connections are made lazily, on first use between two ranks.

An eagerly connected gloo group is a full mesh: every rank holds one socket per peer, so each side
group costs ``world - 1`` descriptors per rank (~1,500 per rank at 512 ranks for three groups).
A side group only ever runs a few collective shapes: all_reduce and all_gather (gloo's ring and
tree algorithms touch O(log N) peers), gather and broadcast to/from rank 0 (rank 0 connects to
every rank, the others to rank 0 only) and point-to-point sends to ring neighbours. With lazy
connections a rank other than 0 therefore holds a handful of sockets per side group whatever the
world size; only rank 0 still pays ``world - 1`` per group it roots (``fd_limit`` counts that).

gloo reads ``TORCH_GLOO_LAZY_INIT`` when a group is constructed, so it is set for exactly that
call (under a lock: groups are made on the main thread, but a library thread could read the
environment meanwhile) and put back as it was; the main training group is left as the user
configured it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch.distributed as dist

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_env_lock = threading.Lock()  # a lock, not state: guards the one-call change of the environment


def new_side_group(timeout_s: float | None = None):
    """A gloo group over all ranks whose connections are made on first use (every rank calls
    this, in the same order as its other ``new_group`` calls: creating a group is collective)."""
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    with _env_lock:
        before = os.environ.get(LAZY_ENV)
        os.environ[LAZY_ENV] = "1"
        try:
            return dist.new_group(backend="gloo", **kwargs)
        finally:
            if before is None:
                os.environ.pop(LAZY_ENV, None)
            else:
                os.environ[LAZY_ENV] = before


def release_side_group(group, what: str) -> None:
    """Destroy ``group`` (None: nothing to do); never raises: a close on an error path must not
    mask the error that brought it there."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception as exc:
        logging.getLogger("podtrain.distributed").debug("destroying the %s group failed: %s", what, exc)


def open_sockets() -> int:
    """Descriptors this process holds now (Linux; 0 where /proc is missing): for tests and benches."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
