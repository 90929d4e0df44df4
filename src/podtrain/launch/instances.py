"""Instance-type presets: GPUs, EFA devices and GPUDirect RDMA for the launchers; GPU model, memory,
collective bandwidth and price for ``podtrain plan``.

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
        gpu_model: the exact key of the GPU in ``podtrain.observe.hardware.PEAK_FLOPS``.
        gpu_memory_gib: memory of one GPU (GiB as the driver reports it, rounded down).
        network_gbps: the node's inter-node network in Gbit/s (EFA, or ENA where there is no EFA).
        intra_busbw_gbps: AllReduce bus bandwidth (GB/s) among the node's GPUs, nccl-tests
            convention, at large messages: NVLink/NVSwitch where present, else PCIe.
    """

    name: str
    gpus: int
    gpu: str
    efa: int
    gpudirect_rdma: bool
    gpu_model: str = ""
    gpu_memory_gib: float = 0.0
    network_gbps: float = 0.0
    intra_busbw_gbps: float = 0.0

    @property
    def inter_busbw_gbps(self) -> float:
        """AllReduce bus bandwidth (GB/s) across nodes: a ring across nodes runs one channel per
        NIC, so its bus bandwidth is the node's network bandwidth (bits to bytes), capped by the
        bandwidth inside the node (a one-GPU node has no inside)."""
        network = self.network_gbps / 8.0
        return min(network, self.intra_busbw_gbps) if self.intra_busbw_gbps else network

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


# Intra-node AllReduce busbw: 8-GPU nccl-tests figures at >= 1 GB messages (NVIDIA's and AWS's
# published runs): A100 NVSwitch (NVLink 3, 600 GB/s per GPU) ~230 GB/s, H100/H200 NVSwitch
# (NVLink 4, 900 GB/s) ~480 GB/s with NVLS, B200 (NVLink 5, 1.8 TB/s) ~800 GB/s; PCIe Gen4 boxes
# without NVLink (A10G, L4, L40S) ~12-20 GB/s.
INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in (
    InstanceType("p4d.24xlarge", 8, "A100 40GB", 4, True, "A100 40GB", 40, 400, 230),
    InstanceType("p4de.24xlarge", 8, "A100 80GB", 4, True, "A100 80GB", 80, 400, 230),
    InstanceType("p5.48xlarge", 8, "H100 80GB", 32, True, "H100 SXM", 80, 3200, 480),
    InstanceType("p5e.48xlarge", 8, "H200 141GB", 32, True, "H200", 141, 3200, 480),
    InstanceType("p5en.48xlarge", 8, "H200 141GB", 16, True, "H200", 141, 3200, 480),
    InstanceType("p6-b200.48xlarge", 8, "B200 180GB", 8, True, "B200", 179, 3200, 800),
    # g5: one EFA interface from 8xlarge up, and no GPUDirect RDMA on the A10G.
    InstanceType("g5.8xlarge", 1, "A10G 24GB", 1, False, "A10G", 22, 25, 0),
    InstanceType("g5.12xlarge", 4, "A10G 24GB", 1, False, "A10G", 22, 40, 12),
    InstanceType("g5.24xlarge", 4, "A10G 24GB", 1, False, "A10G", 22, 50, 12),
    InstanceType("g5.48xlarge", 8, "A10G 24GB", 1, False, "A10G", 22, 100, 12),
    InstanceType("g6.48xlarge", 8, "L4 24GB", 1, False, "L4", 22, 100, 12),
    InstanceType("g6e.48xlarge", 8, "L40S 48GB", 4, False, "L40S", 44, 400, 20),
)}

# vCPUs and host memory (GiB) of each preset, from the EC2 instance-type pages, and the most pods
# the EKS AMIs let its kubelet run (awslabs/amazon-eks-ami, eni-max-pods.txt: ENIs x (IPv4 per ENI
# - 1) + 2; for multi-card types, network card 0 only): the inputs of ``eks_allocatable``.
HOST_SIZES: dict[str, tuple[int, int, int]] = {
    "p4d.24xlarge": (96, 1152, 737), "p4de.24xlarge": (96, 1152, 737), "p5.48xlarge": (192, 2048, 100),
    "p5e.48xlarge": (192, 2048, 100), "p5en.48xlarge": (192, 2048, 198), "p6-b200.48xlarge": (192, 2048, 198),
    "g5.8xlarge": (32, 128, 234), "g5.12xlarge": (48, 192, 737), "g5.24xlarge": (96, 384, 737),
    "g5.48xlarge": (192, 768, 345), "g6.48xlarge": (192, 768, 737), "g6e.48xlarge": (192, 1536, 492),
}

EFA_HUGEPAGES_MIB = 5120
"""2 MiB huge pages (in MiB) a pod using a whole node's EFA devices requests: AWS's EKS EFA
examples (nccl-tests on p5.48xlarge/p4d) request 5120Mi; a pod with a share of the devices asks
that share (``efa_hugepages_mib``), so that the node's pods all fit its reserve."""
EFA_RESERVED_HUGEPAGES_MIB = 5128 * 2
"""What the EFA installer reserves as huge pages (5128 of 2 MiB) on every EFA instance: out of the
node's memory, and not allocatable as memory."""


def efa_share(instance: InstanceType, gpus: int) -> int:
    """EFA devices a pod using ``gpus`` of a node's GPUs asks for by default: its GPUs' share of
    the node's devices, at least one (a pod smaller than that share still talks over EFA; fewer
    such pods then fit a node)."""
    if not instance.efa or not gpus:
        return 0
    return max(1, instance.efa * min(gpus, instance.gpus) // instance.gpus)


def efa_hugepages_mib(instance: InstanceType, efa: int) -> int:
    """2 MiB huge pages (MiB) of a pod using ``efa`` of the node's EFA devices: its devices' share
    of the node's reserve, at most ``EFA_HUGEPAGES_MIB``, in whole pages."""
    share = EFA_RESERVED_HUGEPAGES_MIB * min(efa, instance.efa) // max(1, instance.efa)
    return min(EFA_HUGEPAGES_MIB, share // 2 * 2)

VM_MEMORY_OVERHEAD = 0.075
"""Share of an instance's nominal memory that never reaches the kubelet's capacity (firmware,
hypervisor, kernel): Karpenter's default ``vmMemoryOverheadPercent``, its estimate for EC2."""
EVICTION_HARD_MIB = 100
"""The EKS AMIs' kubelet ``evictionHard: memory.available: 100Mi``."""


@dataclass(frozen=True)
class Allocatable:
    """What the kubelet of an EKS node lets pods request (``eks_allocatable``)."""

    cpu_millicores: int
    """CPU, in thousandths of a core."""
    memory_mib: int
    """Memory, huge pages excluded."""
    hugepages_2mi_mib: int
    """2 MiB huge pages (the EFA installer's), in MiB."""


def kube_reserved_cpu_millicores(vcpus: int) -> int:
    """The EKS AMIs' kube-reserved CPU (nodeadm ``getCPUMillicoresToReserve``, bootstrap.sh before
    it, after GKE's table): 6% of the first core, 1% of the second, 0.5% of the third and fourth,
    0.25% of every core above four."""
    steps = ((1, 60), (1, 10), (2, 5), (max(0, vcpus - 4), 2.5))
    left, reserved = vcpus, 0.0
    for cores, millicores in steps:
        used = min(left, cores)
        reserved += used * millicores
        left -= used
    return int(reserved)


def kube_reserved_memory_mib(max_pods: int) -> int:
    """The EKS AMIs' kube-reserved memory: 11 MiB per pod the node may run + 255 MiB (nodeadm
    ``getMemoryMebibytesToReserve``)."""
    return 11 * max_pods + 255


def eks_allocatable(instance: InstanceType) -> Allocatable:
    """An EKS node's allocatable as the EKS-optimized AMIs (AL2023's nodeadm, AL2's bootstrap.sh)
    configure its kubelet: allocatable = capacity - kube-reserved - system-reserved (none on
    these AMIs) - the hard eviction threshold, where the memory capacity is the nominal memory
    less ``VM_MEMORY_OVERHEAD`` and less the EFA installer's huge pages (on EFA instances), which
    the kubelet counts apart from memory. A node group with its own kubeletExtraConfig reserves
    differently: the pods request ``POD_SHARE`` of this, which leaves room for that too."""
    vcpus, memory_gib, max_pods = HOST_SIZES[instance.name]
    hugepages = EFA_RESERVED_HUGEPAGES_MIB if instance.efa else 0
    capacity_mib = int(memory_gib * 1024 * (1 - VM_MEMORY_OVERHEAD)) - hugepages
    return Allocatable(cpu_millicores=vcpus * 1000 - kube_reserved_cpu_millicores(vcpus),
                       memory_mib=capacity_mib - kube_reserved_memory_mib(max_pods) - EVICTION_HARD_MIB,
                       hugepages_2mi_mib=hugepages)


POD_SHARE = 0.9
"""Share of a node's allocatable CPU and memory the training pods request: the rest is left to the
DaemonSets every GPU node runs (CNI, kube-proxy, the EFA and NVIDIA device plugins, CSI drivers,
HyperPod's health agents), whose requests must fit beside it."""


def pod_resources(instance: InstanceType, gpus: int, efa: int) -> dict[str, str]:
    """CPU and memory requests of a pod using ``gpus`` of the GPUs of one ``instance`` node: its
    GPUs' share of ``POD_SHARE`` of the node's EKS allocatable (``eks_allocatable``), whole
    cores (requests equal to limits make a Guaranteed pod, evicted last, where a Burstable or
    BestEffort one goes first, and whole cores let a static CPU manager pin them), plus its share
    of the EFA huge pages when it uses ``efa`` > 0 devices (``efa_hugepages_mib``: libfabric's
    buffers; the kubelet counts them apart from memory)."""
    node = eks_allocatable(instance)
    share = POD_SHARE * min(1.0, gpus / instance.gpus)
    resources = {"cpu": str(max(1, int(node.cpu_millicores * share) // 1000))}
    if efa and instance.efa:
        resources["hugepages-2Mi"] = f"{efa_hugepages_mib(instance, efa)}Mi"
    resources["memory"] = f"{max(1, int(node.memory_mib * share) // 1024)}Gi"
    return resources


# On-demand USD per instance-hour, Linux, us-east-1, from https://aws.amazon.com/ec2/pricing/on-demand/
# as recorded in May 2025 (before AWS's June 2025 P4/P5 price reductions of up to 45%: check the page
# before booking). Types without a recorded price plan without a cost unless --price-per-hour is given.
PRICES_DATE = "2025-05"
PRICES_SOURCE = "aws.amazon.com/ec2/pricing/on-demand (us-east-1, Linux)"
ON_DEMAND_USD_PER_HOUR: dict[str, float] = {
    "p4d.24xlarge": 32.77, "p4de.24xlarge": 40.97, "p5.48xlarge": 98.32,
    "g5.8xlarge": 2.448, "g5.12xlarge": 5.672, "g5.24xlarge": 8.144, "g5.48xlarge": 16.288,
    "g6.48xlarge": 13.35, "g6e.48xlarge": 30.13,
}


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
