"""Enough file descriptors for the job's gloo groups, checked before any group is made.

An eagerly connected gloo group is a full mesh: each rank holds one socket per peer. podtrain's
side groups (the durable and local checkpoint writers', the peer replicator's, the stop-signal
agreement's under NCCL) connect lazily (``podtrain.distributed.side_group``): a rank other than 0
holds a handful of sockets in each, rank 0 (the root of their gathers and broadcasts) one per
peer. The main group under gloo (CPU runs) is a full mesh. At 512 ranks that is ~2,000
descriptors on rank 0 and ~550 elsewhere with every group in use, beyond the 1,024 soft limit
many images start with on rank 0. ``ensure`` raises the soft limit toward the hard one when that
suffices (unprivileged, as ``ulimit -n`` would) and otherwise stops the rank in one line naming
the limit, the host and the fix, before a collective would fail somewhere deep in gloo with
"Too many open files".
"""

from __future__ import annotations

import math
import resource

from podtrain.errors import UserError

MARGIN = 512
"""Descriptors for everything else: data shards, logs, the store's connections, torch's own."""


def side_peers(world_size: int) -> int:
    """Sockets a rank other than 0 holds in one lazily connected side group: its ring neighbours,
    rank 0, and the O(log N) partners of gloo's tree algorithms (measured in tests/test_env.py)."""
    return min(max(0, world_size - 1), 8 + 2 * math.ceil(math.log2(max(2, world_size))))


def side_groups(local_tier: bool, main_backend: str) -> int:
    """The side groups a training rank opens: the durable writer's; with a local tier the local
    writer's and the replicator's; under a non-gloo main backend, the stop-signal agreement's."""
    return 1 + (2 if local_tier else 0) + (1 if main_backend != "gloo" else 0)


def sockets_needed(world_size: int, rank: int, side: int, main_gloo: bool) -> int:
    """Descriptors rank ``rank`` needs: the main group's full mesh under gloo, ``side`` lazily
    connected side groups (one socket per peer on rank 0, ``side_peers`` elsewhere), ``MARGIN``."""
    peers = max(0, world_size - 1)
    return (peers if main_gloo else 0) + side * (peers if rank == 0 else side_peers(world_size)) + MARGIN


def ensure(need: int, host: str, limits=None) -> int:
    """Make sure this process may open ``need`` descriptors (``sockets_needed``); returns the soft
    limit now in force. ``limits`` (soft, hard) replaces ``getrlimit`` in tests."""
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return soft
    if hard == resource.RLIM_INFINITY or need <= hard:
        target = need if hard == resource.RLIM_INFINITY else min(hard, 2 * need)
        if limits is None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    raise UserError(f"this rank needs ~{need} file descriptors (its gloo groups' sockets + {MARGIN}) but the "
                    f"limit on host {host} is {soft} (hard {hard}): raise it for the job (ulimit -n in the "
                    "batch script, LimitNOFILE for the container runtime, or the pod's securityContext / the "
                    "node's containerd limits)")
