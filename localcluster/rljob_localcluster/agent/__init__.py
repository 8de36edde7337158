"""Test-only node agent: stands in for kubelet + a container runtime on the local control plane
(DESIGN §8), where no container engine exists. README.md beside this file documents it in full.

It registers Nodes (cpu, memory, fake ``nvidia.com/gpu``), renews their Leases, and runs the pods
bound to them as process trees: **images are not pulled** (every image maps to the project's own
Python environment, so containers must set ``command``), each pod has its own network namespace
and address on bridge ``rljob0``, each container its own mount/UTS/PID namespaces with volumes
bind-mounted at their real paths. Names resolve from hosts files built from EndpointSlices (no
CoreDNS, no kube-proxy: a ClusterIP Service name resolves to its pod IPs). Status, probes,
restarts, deletion and ``kubectl logs`` behave as with kubelet.

    python -m rljob_localcluster.agent --kubeconfig K --nodes 2 --gpus-per-node 4 --state-dir D

    with Agent(AgentConfig(kubeconfig=K, state_dir=D)) as agent:
        ...
        print(logs("default", "my-pod", state_dir=D))
"""

from .agent import Agent, AgentConfig, AgentError
from .logs import log_path, logs

__all__ = ["Agent", "AgentConfig", "AgentError", "log_path", "logs"]
