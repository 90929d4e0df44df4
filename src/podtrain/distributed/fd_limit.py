"""Enough file descriptors for the job's gloo groups, checked before any group is made.

Every gloo group is a full mesh: each rank holds one socket per peer. A rank of a podtrain job
opens the main group (under gloo), the stop-signal agreement's CPU group (under NCCL), the durable
checkpoint writer's group and, with ``ckpt.local_dir``, the local writer's: at 512 ranks that is
~1,500 sockets per rank, beyond the 1,024 soft limit many images start with. ``ensure`` raises the
soft limit toward the hard one when that suffices (unprivileged, as ``ulimit -n`` would) and
otherwise stops the rank in one line naming the limit, the host and the fix, before a collective
would fail somewhere deep in gloo with "Too many open files".
"""

from __future__ import annotations

import resource

from podtrain.errors import UserError

MARGIN = 512
"""Descriptors for everything else: data shards, logs, the store's connections, torch's own."""


def sockets_needed(world_size: int, gloo_groups: int) -> int:
    """Descriptors one rank needs: one socket per peer in each gloo group, plus ``MARGIN``."""
    return gloo_groups * max(0, world_size - 1) + MARGIN


def gloo_groups(local_tier: bool) -> int:
    """The gloo groups a training rank opens: the main group (gloo) or the stop-signal one (nccl),
    the durable writer's, and the local writer's with a local tier."""
    return 1 + 1 + (1 if local_tier else 0)  # main (gloo) or stop-signal group (nccl); writers


def ensure(world_size: int, groups: int, host: str, limits=None) -> int:
    """Make sure this process may open ``sockets_needed`` descriptors; returns the soft limit now
    in force. ``limits`` (soft, hard) replaces ``getrlimit`` in tests."""
    need = sockets_needed(world_size, groups)
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return soft
    if hard == resource.RLIM_INFINITY or need <= hard:
        target = need if hard == resource.RLIM_INFINITY else min(hard, 2 * need)
        if limits is None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    raise UserError(f"this rank needs ~{need} file descriptors ({groups} gloo groups x {world_size - 1} peers "
                    f"+ {MARGIN}) but the limit on host {host} is {soft} (hard {hard}): raise it for the job "
                    "(ulimit -n in the batch script, LimitNOFILE for the container runtime, or the pod's "
                    "securityContext / the node's containerd limits)")
