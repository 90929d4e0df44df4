"""Where a node actually sits: its address and interface toward the rendezvous host.

``placement_line(ctx)`` is the one line each node's first rank prints at start, so users see the
topology they got (host, address, interface, node rank, local world size, backend) instead of the
one they meant. ``python -m podtrain.distributed.placement route HEAD`` prints this node's address and
interface toward HEAD; the Slurm node script uses it to pin gloo's interface and torchrun's
``--local-addr``. This module imports no torch, so that call costs milliseconds.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
from typing import Any

from podtrain.distributed.env import launcher_variables

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def route_to(host: str, port: int = 9) -> tuple[str, str]:
    """``(local address, interface)`` this machine would use to reach ``host``.

    A UDP "connect" sends nothing; it only asks the kernel's routing table for the source address.
    Unresolvable hosts give ``("?", "?")`` rather than an exception: this is diagnostics.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            addr = s.getsockname()[0]
    except OSError:
        return "?", "?"
    return addr, interface_of(addr)


def interface_of(addr: str) -> str:
    """The name of the interface that holds IPv4 address ``addr`` (``lo`` for 127.x), or ``?``."""
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == addr:
            return name
    return "lo" if addr.startswith("127.") else "?"


def ipv4_of(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname`` (SIOCGIFADDR), or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # interface without an IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def format_placement(*, host: str, addr: str, iface: str, node_rank: int, num_nodes: int,
                     local_world_size: int, rank: int, world_size: int, backend: str,
                     device: str, master: str, launcher: str) -> str:
    """The placement line from its parts (pure, for tests)."""
    first, last = rank, rank + local_world_size - 1
    return (f"placement: host={host} addr={addr} iface={iface} node={node_rank}/{num_nodes} "
            f"local_world_size={local_world_size} ranks={first}-{last}/{world_size} "
            f"backend={backend} device={device} master={master} launcher={launcher}")


def placement_line(ctx: Any) -> str:
    """One line describing this node, for its first local rank to print at start.

    ``ctx`` is a ``podtrain.distributed.group.DistContext`` (anything with ``env``, ``backend`` and
    ``device``). The interface is the one named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when
    set (what the backend will bind), else the one the kernel routes toward the master through.
    """
    env = ctx.env
    addr, iface = route_to(env.master_addr, env.master_port)
    pinned = launcher_variables().get("NCCL_SOCKET_IFNAME" if ctx.backend == "nccl"
                                      else "GLOO_SOCKET_IFNAME")
    if pinned:
        iface = f"{pinned}(set)" if pinned != iface else iface
    return format_placement(
        host=env.hostname, addr=addr, iface=iface, node_rank=env.node_rank,
        num_nodes=env.num_nodes, local_world_size=env.local_world_size,
        rank=env.rank - env.local_rank, world_size=env.world_size, backend=ctx.backend,
        device=str(ctx.device), master=f"{env.master_addr}:{env.master_port}",
        launcher=env.launcher)


def main(argv: list[str]) -> int:
    """``route HOST``: print ``ADDRESS INTERFACE`` toward HOST (exit 1 when unroutable)."""
    if len(argv) != 2 or argv[0] != "route":
        print("usage: python -m podtrain.distributed.placement route HOST", file=sys.stderr)
        return 2
    addr, iface = route_to(argv[1])
    print(addr, iface)
    return 0 if addr != "?" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
