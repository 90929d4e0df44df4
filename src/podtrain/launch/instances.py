"""Instance-type presets for the cluster launchers: GPUs, EFA devices, GPUDirect RDMA.

``--instance-type p5.48xlarge`` fills what users otherwise get wrong: how many GPUs a node has, how
many EFA interfaces to request on Kubernetes (without them NCCL silently falls back to TCP
sockets), and whether libfabric may register GPU memory with the EFA device directly
(``FI_EFA_USE_DEVICE_RDMA=1``, only on instances with GPUDirect RDMA). HyperPod names its
instances with an ``ml.`` prefix (``ml.p5.48xlarge``); both spellings are accepted.

Trainium (trn1/trn2) is left out on purpose: it runs Neuron devices through torch-neuronx, not
CUDA/NCCL, so none of these launch scripts apply to it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from podtrain.errors import UserError


@dataclass(frozen=True)
class InstanceType:
    """What one node of a given EC2 instance type offers a DDP job.

    Attributes:
        name: EC2 name without the ``ml.`` prefix.
        gpus: GPUs per node.
        gpu: the GPU model, for messages.
        efa: EFA interfaces (the count of ``vpc.amazonaws.com/efa`` a pod requests); 0 = none.
        gpudirect_rdma: whether EFA can read/write GPU memory directly (FI_EFA_USE_DEVICE_RDMA).
    """

    name: str
    gpus: int
    gpu: str
    efa: int
    gpudirect_rdma: bool

    def fabric_env(self) -> dict[str, str]:
        """libfabric variables for NCCL over EFA on this instance; empty when it has no EFA."""
        if not self.efa:
            return {}
        return {
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1" if self.gpudirect_rdma else "0",
            # NCCL's workers fork (data loaders); without this, libfabric's registered memory
            # may be corrupted in the child.
            "FI_EFA_FORK_SAFE": "1",
        }


INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in (
    InstanceType("p4d.24xlarge", 8, "A100 40GB", 4, True),
    InstanceType("p4de.24xlarge", 8, "A100 80GB", 4, True),
    InstanceType("p5.48xlarge", 8, "H100 80GB", 32, True),
    InstanceType("p5e.48xlarge", 8, "H200 141GB", 32, True),
    InstanceType("p5en.48xlarge", 8, "H200 141GB", 16, True),
    # g5: one EFA interface from 8xlarge up, and no GPUDirect RDMA on the A10G.
    InstanceType("g5.8xlarge", 1, "A10G 24GB", 1, False),
    InstanceType("g5.12xlarge", 4, "A10G 24GB", 1, False),
    InstanceType("g5.24xlarge", 4, "A10G 24GB", 1, False),
    InstanceType("g5.48xlarge", 8, "A10G 24GB", 1, False),
)}


def lookup(name: str) -> InstanceType:
    """The preset for ``name`` (``p5.48xlarge`` or ``ml.p5.48xlarge``); UserError when unknown."""
    bare = name.removeprefix("ml.")
    if bare in INSTANCE_TYPES:
        return INSTANCE_TYPES[bare]
    if bare.startswith(("trn", "inf")):
        raise UserError(f"--instance-type {name}: Trainium/Inferentia nodes run Neuron, not CUDA; "
                        "podtrain's launchers support GPU instances only")
    close = difflib.get_close_matches(bare, list(INSTANCE_TYPES), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(f"--instance-type {name} is not a known preset{hint}; known: "
                    f"{', '.join(INSTANCE_TYPES)} (or pass --gpus-per-node without a preset)")


def resolve_gpus(instance: InstanceType | None, gpus_per_node: int | None) -> int:
    """GPUs per node from the flag and the preset; UserError when they disagree or are missing."""
    if instance is None:
        if gpus_per_node is None:
            raise UserError("give --gpus-per-node G (0 for a CPU partition) or --instance-type TYPE")
        if gpus_per_node < 0:
            raise UserError(f"--gpus-per-node must be 0 or more, got {gpus_per_node}")
        return gpus_per_node
    if gpus_per_node is None:
        return instance.gpus
    if not 1 <= gpus_per_node <= instance.gpus:
        raise UserError(f"--gpus-per-node {gpus_per_node} does not fit --instance-type "
                        f"{instance.name}, which has {instance.gpus} x {instance.gpu}")
    return gpus_per_node
