"""The simulated nodes a local cluster posts (KWOK keeps the capacity given at creation) and the
address plans its pods get: a private network namespace's, or loopback's without one."""
from __future__ import annotations

from dataclasses import dataclass, field

GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/hca_shared_devices_a"  # as the RDMA shared device plugin advertises it


@dataclass
class NodeSpec:
    """One simulated node; KWOK keeps the capacity we post at creation."""
    name: str
    gpus: int = 8
    memory: str = "1Ti"
    cpu: str = "128"
    rdma: int = 0  # RDMA devices (RDMA_RESOURCE)
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)


@dataclass
class Network:
    kwok_cidr: str      # pods KWOK simulates
    runner_cidr: str    # pods run as real processes
    node_net: str        # node i gets the (i+1)-th address of this network
    endpoints_work: bool


PRIVATE_NET = Network("10.244.0.0/17", "10.244.128.0/17", "10.243.0.0/16", True)
LOOPBACK_NET = Network("127.1.0.0/17", "127.1.128.0/17", "127.0.0.0/24", False)


def default_nodes(n_gpu: int = 3, n_cpu: int = 1) -> list[NodeSpec]:
    """GPU nodes cycle through 1Ti, 512Gi and 2Ti of memory (the samples' messages name gpu-1)."""
    nodes = [NodeSpec(f"gpu-{i}", gpus=8, rdma=8, memory=("1Ti", "512Gi", "2Ti")[i % 3],
                      labels={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
             for i in range(n_gpu)]
    nodes += [NodeSpec(f"cpu-{i}", gpus=0, memory="256Gi") for i in range(n_cpu)]
    return nodes
