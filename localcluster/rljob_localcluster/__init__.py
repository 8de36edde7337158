"""rljob's local test cluster: a real Kubernetes control plane built from source (see
``localcluster/build-go-tools.sh``) and started on loopback.

    from rljob_localcluster import ControlPlane
    with ControlPlane() as cp:
        print(cp.kubeconfig)

CLI: ``python -m rljob_localcluster up|down|status|env|tools``.
"""

from .controlplane import ControlPlane, ControlPlaneError
from .tools import pinned_versions, tool, tools_bin_dir

__all__ = ["ControlPlane", "ControlPlaneError", "pinned_versions", "tool", "tools_bin_dir"]
