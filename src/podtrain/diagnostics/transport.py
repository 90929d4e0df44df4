"""Which network transport NCCL uses on a node, read from NCCL's own start-up log.

On EFA instances NCCL reaches the EFA devices only through the aws-ofi-nccl plugin ("NET/OFI",
libfabric); when the plugin is missing or fails to load, NCCL silently falls back to TCP sockets
("NET/Socket") and collectives run about 10x slower, with nothing in the job's output but one
INFO line. ``probe`` runs one tiny all_reduce in a subprocess with ``NCCL_DEBUG=INFO`` and
``NCCL_DEBUG_SUBSYS=INIT,NET`` (the same Python, torch, NCCL, plugin path and environment as
training), and ``parse_nccl_network`` reads the transport from its lines:

* ``NCCL INFO Using network Libfabric`` (``AWS Libfabric`` with older plugins), ``IB``, ``Socket``:
  the network NCCL chose at init;
* ``... via NET/Socket/0`` (also ``NET/AWS Libfabric/0``, ``NET/IB/0``): the connections it made
  (present when the communicator spans nodes) win over the line above;
* without either: the device lines, ``NET/OFI Selected Provider is efa``, ``NET/IB : Using [0]...``,
  ``NET/Socket : Using [0]...``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from typing import Any

NET_OFI, NET_IB, NET_SOCKET = "NET/OFI", "NET/IB", "NET/Socket"
"""The transports named in the report: aws-ofi-nccl (EFA), InfiniBand/RoCE verbs, TCP sockets."""

NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
"""What makes NCCL print its network choice (and little else) at init."""

_USING_NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$", re.MULTILINE)
_VIA_NET = re.compile(r" via NET/([^/\n]+)/\d+")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\w+)")
_DEVICE_LINES = ((re.compile(r"NET/OFI (?:Selected [Pp]rovider|Initializing aws-ofi-nccl)"), NET_OFI),
                 (re.compile(r"NET/IB ?: Using \["), NET_IB),
                 (re.compile(r"NET/Socket ?: Using \["), NET_SOCKET))


def transport_of(network: str) -> str:
    """NCCL's network name (``Libfabric``, ``AWS Libfabric``, ``IB``, ``IBext_v8``, ``Socket``) as a
    transport."""
    name = network.strip()
    if "libfabric" in name.lower() or name.upper() == "OFI":
        return NET_OFI
    if name.startswith("IB"):  # IB, or HPC-X's IBext_v8 plugin
        return NET_IB
    return f"NET/{name}"  # Socket, or another plugin (e.g. GPUDirectTCPX) as NCCL names it


def parse_nccl_network(log: str) -> dict[str, Any] | None:
    """``{"transport", "network", "provider"}`` from NCCL's INIT/NET log lines, or None when the
    log names no network (NCCL did not initialize, or ``NCCL_DEBUG`` was not INFO)."""
    provider = _OFI_PROVIDER.search(log)
    provider_name = provider[1] if provider else None
    via = _VIA_NET.findall(log)
    if via:
        # The connections made: a socket among them is the fallback, whatever was loaded.
        names = sorted(set(via), key=via.index)
        worst = next((n for n in names if transport_of(n) == NET_SOCKET), names[0])
        return {"transport": transport_of(worst), "network": worst, "provider": provider_name}
    using = _USING_NETWORK.findall(log)
    if using:
        return {"transport": transport_of(using[-1]), "network": using[-1], "provider": provider_name}
    for pattern, transport in _DEVICE_LINES:
        if pattern.search(log):
            return {"transport": transport, "network": None, "provider": provider_name}
    return None


def probe(timeout_s: float = 120.0) -> dict[str, Any]:
    """Run one all_reduce in a one-rank subprocess on this node's first GPU with NCCL's INFO log;
    the parsed transport, or ``{"error": ...}`` when NCCL said nothing about its network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "SLURM_", "NCCL_DEBUG"))}
    with socket.socket() as s:  # a free port for the one-rank group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(NCCL_LOG_ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        proc = subprocess.run([sys.executable, "-m", "podtrain.diagnostics.transport"], env=env,
                              capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the NCCL probe did not finish within {timeout_s:g} s"}
    found = parse_nccl_network(proc.stdout + proc.stderr)
    if found is not None:
        return found
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {"error": f"NCCL named no network ({last[:200]})"}


def _one_all_reduce() -> None:
    """The probe's body: a one-rank process group on this node's GPU and one all_reduce."""
    import torch

    from podtrain.distributed.group import process_group

    with process_group(backend="auto", init_timeout_s=60, timeout_s=60) as ctx:
        ctx.all_reduce_sum(torch.ones(1, device=ctx.device))
        ctx.barrier()


if __name__ == "__main__":  # the subprocess of ``probe``
    _one_all_reduce()
