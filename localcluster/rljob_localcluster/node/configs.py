"""The configuration files of a local node's components (pure functions: paths and ports in, text out).

JSON is valid YAML, so the kubelet's and kube-proxy's configuration files are written as JSON.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from .. import images as _images

__all__ = [
    "CLUSTER_CIDR",
    "CLUSTER_DOMAIN",
    "CNI_BIN_DIR",
    "DNS_SERVICE_IP",
    "GPU",
    "PAUSE_IMAGE",
    "RUN_DIR",
    "NodeLayout",
    "cni_conflist",
    "containerd_config",
    "containerd_socket",
    "corefile",
    "kube_proxy_config",
    "kubelet_config",
    "pod_cidr",
]

#: The sandbox ("pause") image containerd's CRI plugin runs for every pod: the tag kubelet/kubeadm v1.34
#: use (kubeadm's PauseVersion 3.10.1); localcluster/build-images.sh builds and tags it.
PAUSE_IMAGE = _images.PAUSE_IMAGE
#: The extended resource the nodes advertise (fake GPUs; node/controller.py patches it into node status).
GPU = "nvidia.com/gpu"
#: The default StorageClass's provisioner (node/controller.py) and the annotation on the volumes it made.
PROVISIONER = "rljob.dev/local-hostpath"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
#: Where Debian's containernetworking-plugins puts the CNI plugins.
CNI_BIN_DIR = "/usr/lib/cni"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
#: The conventional kube-dns ClusterIP (kubeadm: the 10th address of the Service range).
DNS_SERVICE_IP = "10.96.0.10"
#: Node status timings matching ``controlplane.NODE_TIMINGS`` (node-monitor-grace-period 16s): the lease is
#: renewed every nodeLeaseDurationSeconds / 4 = 4 s.
NODE_LEASE_SECONDS = 16
NODE_STATUS_UPDATE = "4s"


#: Where the nodes' containerd sockets live: unix socket paths must stay under 108 bytes, which a state dir
#: deep in a temp dir would break. One set of local nodes per host, so the node name is unique here.
RUN_DIR = Path("/run/rljob-nodes")


def containerd_socket(name: str) -> Path:
    """The containerd socket of node ``name``: ``/run/rljob-nodes/<name>/containerd.sock``."""
    return RUN_DIR / name / "containerd.sock"


def pod_cidr(index: int) -> str:
    """Node ``index``'s pod CIDR: 10.244.<index>.0/24."""
    net = ipaddress.ip_network(CLUSTER_CIDR)
    return str(list(net.subnets(new_prefix=24))[index])


@dataclass(frozen=True)
class NodeLayout:
    """Where one node's files live and which ports it uses.

    Fields: ``index`` (0..), ``name`` (``rljob-node-<index>``), ``dir`` (``<state dir>/<name>``),
    ``containerd_root`` (kept across runs: a cache of unpacked images), ``host_ip`` (what the kubelet serves
    and registers on), ``kubelet_port`` / ``kubelet_healthz_port`` (TCP).

    Derived (properties):

    ==================== ==========================================================================
    bridge               ``rljob-cni<index>``: the node's CNI bridge, gateway 10.244.<index>.1
    cgroup_root          ``/<name>``: kubelet's cgroupRoot in every hierarchy
    pod_cidr             ``10.244.<index>.0/24``
    containerd_state     ``<dir>/containerd-state`` (runc state, netns mounts, shim bundles)
    containerd_socket    ``/run/rljob-nodes/<name>/containerd.sock`` (:func:`containerd_socket`)
    containerd_config    ``<dir>/containerd.toml``
    cni_conf_dir         ``<dir>/cni/net.d`` (the conflist the CRI plugin reads)
    cni_ipam_dir         ``<dir>/cni/ipam`` (host-local's leases)
    kubelet_root         ``<dir>/kubelet`` (``--root-dir``: pods' volumes, plugins, checkpoints)
    kubelet_config       ``<dir>/kubelet.yaml``
    kubeconfig           ``<dir>/kubelet.kubeconfig`` (user ``system:node:<name>``)
    pki                  ``<dir>/pki`` (the kubelet's serving certificate)
    pod_logs             ``<dir>/pod-logs`` (kubelet's podLogsDir)
    ==================== ==========================================================================
    """

    index: int
    name: str
    dir: Path  # <state>/<name>
    containerd_root: Path  # kept across up/down (a cache of unpacked images)
    host_ip: str
    kubelet_port: int
    kubelet_healthz_port: int

    @property
    def bridge(self) -> str:
        return f"rljob-cni{self.index}"

    @property
    def cgroup_root(self) -> str:
        return f"/{self.name}"

    @property
    def pod_cidr(self) -> str:
        return pod_cidr(self.index)

    @property
    def containerd_state(self) -> Path:
        return self.dir / "containerd-state"

    @property
    def containerd_socket(self) -> Path:
        return containerd_socket(self.name)

    @property
    def containerd_config(self) -> Path:
        return self.dir / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.dir / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.dir / "kubelet.yaml"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubelet.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"


def _toml_str(s: str | Path) -> str:
    return json.dumps(str(s))  # a JSON string is a valid TOML basic string


def containerd_config(node: NodeLayout, *, snapshotter: str = "overlayfs", sandbox_image: str = PAUSE_IMAGE,
                      cni_bin_dir: str = CNI_BIN_DIR) -> str:
    """containerd 1.6 config (version 2) for one node: own root, state, sockets; CRI with the node's CNI
    conf dir; runc via the v2 shim with cgroupfs; ``restrict_oom_score_adj`` because root here lacks
    CAP_SYS_RESOURCE (runc could not lower the pause container's oom_score_adj)."""
    cri = '"io.containerd.grpc.v1.cri"'
    return f"""# written by rljob_localcluster.nodes for {node.name}
version = 2
root = {_toml_str(node.containerd_root)}
state = {_toml_str(node.containerd_state)}
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = {_toml_str(node.containerd_socket)}

[ttrpc]
  address = {_toml_str(str(node.containerd_socket) + ".ttrpc")}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = {_toml_str(node.containerd_root / "opt")}
  [plugins."io.containerd.monitor.v1.cgroups"]
    no_prometheus = true
  [plugins.{cri}]
    sandbox_image = {_toml_str(sandbox_image)}
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    disable_apparmor = true
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    max_container_log_line_size = 16384
    [plugins.{cri}.containerd]
      snapshotter = {_toml_str(snapshotter)}
      default_runtime_name = "runc"
      discard_unpacked_layers = false
      [plugins.{cri}.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.{cri}.containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = {_toml_str(node.containerd_state / "runc")}
    [plugins.{cri}.cni]
      bin_dir = {_toml_str(cni_bin_dir)}
      conf_dir = {_toml_str(node.cni_conf_dir)}
      max_conf_num = 1
"""


def cni_conflist(node: NodeLayout) -> dict:
    """bridge (the node's own bridge, gateway on it) + host-local IPAM on the node's /24 + portmap. No IP
    masquerade: pods only talk to pods, Services and the host, all on this machine, so pod-to-pod traffic
    across nodes keeps its source address. containerd adds the loopback plugin itself."""
    return {
        "cniVersion": "1.0.0",
        "name": node.name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": node.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.cni_ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(node: NodeLayout, *, ca_file: str, tls_cert: str, tls_key: str) -> dict:
    """KubeletConfiguration of one node (see localcluster/README.md for why each setting)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.host_ip,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": node.kubelet_healthz_port,
        "tlsCertFile": tls_cert,
        "tlsPrivateKeyFile": tls_key,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True, "cacheTTL": "30s"},
            "x509": {"clientCAFile": ca_file},
        },
        "authorization": {"mode": "Webhook", "webhook": {"cacheAuthorizedTTL": "30s", "cacheUnauthorizedTTL": "5s"}},
        # cgroup v1 host without systemd as init: cgroupfs, each node under its own root.
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "imageServiceEndpoint": f"unix://{node.containerd_socket}",
        "runtimeRequestTimeout": "5m",
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "podLogsDir": str(node.pod_logs),
        "volumePluginDir": str(node.dir / "volume-plugins"),
        "staticPodPath": "",
        "hairpinMode": "hairpin-veth",
        "maxPods": 110,
        "podPidsLimit": -1,
        "serializeImagePulls": False,
        # Short status timings: node faults show within seconds (see controlplane.NODE_TIMINGS).
        "nodeStatusUpdateFrequency": NODE_STATUS_UPDATE,
        "nodeStatusReportFrequency": "10s",
        "nodeLeaseDurationSeconds": NODE_LEASE_SECONDS,
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "httpCheckFrequency": "10s",
        "shutdownGracePeriod": "0s",
        # A shared development disk: evict only when it is really full.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
            "imagefs.inodesFree": "1%",
        },
        "evictionPressureTransitionPeriod": "10s",
        # Images are imported from local archives and cannot be pulled back: never garbage-collect them
        # (usage never exceeds 100 %; no maximum age).
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "87600h",
        "containerLogMaxSize": "10Mi",
        "containerLogMaxFiles": 3,
        "enableDebuggingHandlers": True,
        "enableServer": True,
        "kubeAPIQPS": 50,
        "kubeAPIBurst": 100,
        "registerNode": True,
    }


def kubelet_args(node: NodeLayout, kubelet_bin: str) -> list[str]:
    """The kubelet's command line for ``node`` (``kubelet_bin`` first): its config, kubeconfig, root and
    cert dirs, node name and IP; the rest is in :func:`kubelet_config`."""
    return [
        kubelet_bin,
        f"--config={node.kubelet_config}",
        f"--kubeconfig={node.kubeconfig}",
        f"--root-dir={node.kubelet_root}",
        f"--cert-dir={node.pki}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.host_ip}",
        "--v=1",
    ]


def kube_proxy_config(*, kubeconfig: str, hostname: str, node_ip: str, healthz_port: int, metrics_port: int) -> dict:
    """One kube-proxy for the host, iptables mode. It touches no conntrack sysctl (maxPerCore 0, timeouts
    0) and no route_localnet (localhostNodePorts false); it keeps its own oom_score_adj (lowering it needs
    CAP_SYS_RESOURCE)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig, "qps": 50, "burst": 100},
        "mode": "iptables",
        "clusterCIDR": CLUSTER_CIDR,
        "hostnameOverride": hostname,
        "bindAddress": node_ip,
        "nodePortAddresses": ["primary"],
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "oomScoreAdj": 0,
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"localhostNodePorts": False, "masqueradeAll": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
        "configSyncPeriod": "15m",
    }


def corefile(*, bind_ip: str, port: int, health_port: int, ready_port: int, kubeconfig: str) -> str:
    """CoreDNS as cluster DNS: the kubernetes plugin (Services, headless Services' pod names, pods) for
    cluster.local and the reverse zones, everything else forwarded to the host's resolvers."""
    return f""".:{port} {{
    bind {bind_ip}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} rljob-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf {{
        max_concurrent 100
    }}
    cache 5
    loadbalance
}}
"""
