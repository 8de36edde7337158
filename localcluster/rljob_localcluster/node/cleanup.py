"""Host bookkeeping of the local nodes: the state file (pids, recorded sysctls, what existed before), the
host-wide lock, and undoing everything the nodes did (:func:`clean_host`, also after a crash)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .. import statefile
from ..pids import cmdline, terminate_all
from . import configs, host

if TYPE_CHECKING:
    from ..controlplane import ControlPlane

__all__ = ["EGRESS_CHAIN", "HOST_LOCK", "HOST_PATHS", "ROUTE_SINK", "STATE_FILE", "NodesError", "clean_host",
           "host_leftovers", "node_names"]


class NodesError(RuntimeError):
    """The local nodes could not start or be cleaned (the message says why)."""


def node_names(count: int = 2) -> list[str]:
    """The names of ``count`` local nodes: ``rljob-node-0`` ... ``rljob-node-<count-1>``."""
    return [f"rljob-node-{i}" for i in range(count)]


HOST_LOCK = Path("/run/rljob-local-nodes.lock")
#: Host paths the kubelet, containerd or the CNI plugins create when missing (hard-coded there). clean_host
#: removes what the nodes put there (see :func:`_remove_paths`); a path that did not exist before start goes
#: too when nothing but empty directories is left in it.
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/containerd",
              "/var/run/netns", "/usr/libexec/kubernetes", "/etc/cni", "/opt/cni")
#: Port-less bridge holding the routes of the Service and pod ranges (see host.add_route_sink).
ROUTE_SINK = "rljob-sink0"
#: filter chain that keeps pods' packets from leaving by the host's uplink (removed with the CNI-* chains).
EGRESS_CHAIN = "CNI-RLJOB-HOST-ONLY"
#: The nodes' state file in their state dir (what clean_host works from).
STATE_FILE = "state.json"
#: Where the kubelet links the pod logs from (hard-coded), containerd's CNI result cache, and the kubelet dir
#: whose ``device-plugins/`` every kubelet of the host shares (hard-coded).
LOG_LINK_DIRS = (Path("/var/log/containers"), Path("/var/log/pods"))
CNI_RESULTS_DIR = Path("/var/lib/cni/results")
KUBELET_DIR = Path("/var/lib/kubelet")
#: containerd 1.6's shim sockets: ``<dir>/<sha256 of "<containerd socket>/<namespace>/<task id>">``
#: (runtime/v2/shim SocketAddress; the dir is hard-coded there).
SHIM_SOCKET_DIR = Path("/run/containerd/s")


class _HostLock:
    """One set of local nodes per host (bridges, cgroup names, kube-proxy's chains are host-wide)."""

    def __init__(self) -> None:
        self.fd: IO[str] | None = None

    def acquire(self, state_dir: Path) -> None:
        """Take the lock and write who holds it into it. Raises NodesError naming the holder when it is held."""
        HOST_LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = open(HOST_LOCK, "a+")  # noqa: SIM115 - held while the nodes run
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fd.seek(0)
            owner = fd.read().strip()
            fd.close()
            raise NodesError(f"local nodes already run on this host ({owner}); stop them first "
                             "('python -m rljob_localcluster down' for the CLI's cluster)") from None
        fd.seek(0)
        fd.truncate()
        fd.write(f"state dir {state_dir}, pid {os.getpid()}\n")
        fd.flush()
        self.fd = fd

    def release(self) -> None:
        """Let go of the lock (nothing when not held)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.fd.truncate(0)
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.fd.close()
            self.fd = None


def _lock_is_free() -> bool:
    try:
        with open(HOST_LOCK, "a+") as fd:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


# ==================================================================================================== clean_host
def clean_host(state_dir: str | os.PathLike, *, control_plane: ControlPlane | None = None,
               log: Callable[[str], None] | None = None, locked: bool = False, keep_files: bool = False) -> list[str]:
    """Remove everything local nodes of ``state_dir`` started or left on the host — also after a crash, from
    ``state.json`` alone — in this order:

    1. their processes (recorded pids whose command line still names this run), every process left in the
       ``/rljob-node-<i>`` cgroups (containers), the containerd shims of their sockets;
    2. mounts below the state dir and the containerd roots (lazily, deepest first);
    3. the CNI-*/KUBE-* iptables and ip6tables chains that were not there before start (``chains_before``;
       kube-proxy's, kubelet's, portmap's, ours) with the rules that jump to them; the bridges, the route sink;
    4. the cgroups, and the sysctls (written back as recorded);
    5. what they put in the host paths (:data:`HOST_PATHS`): their shim sockets, the ``/var/log/containers``
       links into the state dir, their CNI result cache, ``/var/lib/kubelet/device-plugins``; a host path
       that did not exist before start goes when only empty directories are left in it, else it is kept
       and said so;
    6. with a reachable ``control_plane``: the Node objects and the PersistentVolumes provisioned under
       ``<state_dir>/pv``;
    7. the state dir but for ``logs/`` (only ``state.json`` with ``keep_files``), unless something of the nodes
       is left: then all of it, for another clean_host.

    The containerd roots (image cache) are kept. Returns one line per thing removed or kept; a line that
    starts with ``WARNING`` names something of the nodes that is still there.

    Raises:
        NodesError: local nodes still run on this host (the host lock is held) and not ``locked``.
    """
    sd = Path(state_dir).resolve()
    st = statefile.read(sd / STATE_FILE)
    if not st:
        return []
    if not locked and not _lock_is_free():
        raise NodesError(f"local nodes still run on this host ({HOST_LOCK}); stop their owner first")
    report = [*_end_processes(st), *_unmount(sd, st), *_clean_network(st), *_restore_host(st),
              *_remove_paths(sd, st)]
    if control_plane is not None:
        report += _delete_api_objects(control_plane, st.get("names") or [], sd)
    report += _remove_state_dir(sd, keep_files, failed=any(ln.startswith("WARNING") for ln in report))
    for line in report:
        (log or (lambda m: None))(line)
    return report


def _end_processes(st: dict) -> list[str]:
    """The recorded processes (kubelets, kube-proxy, CoreDNS, controller), then the containers (everything in the
    nodes' cgroups, before their shims go), then containerd and its shims."""
    report = []
    names = st.get("names") or []
    recorded = st.get("pids") or {}
    non_ctd = [(v["pid"], v["marks"]) for k, v in recorded.items() if not k.startswith("containerd-")]
    if ended := terminate_all(non_ctd, 20):
        report.append(f"ended processes {ended}")
    for n in names:
        with contextlib.suppress(RuntimeError):
            host.kill_cgroup_tree(n, timeout=0.5, remove=False)  # kill only; removal in _restore_host
    ctd = [(v["pid"], v["marks"]) for k, v in recorded.items() if k.startswith("containerd-")]
    if ended := terminate_all(ctd, 20):
        report.append(f"ended containerd {ended}")
    shims = []
    for n in names:
        sock = str(configs.containerd_socket(n))
        shims += [(p, ("containerd-shim", sock)) for p in host.pids_with_cmdline("containerd-shim", sock)]
    if ended := terminate_all(shims, 5):
        report.append(f"ended containerd shims {ended}")
    return report


def _unmount(sd: Path, st: dict) -> list[str]:
    """Netns bind mounts, rootfs overlays and kubelet volumes below the state dir and the containerd roots."""
    roots = [Path(r) for r in st.get("containerd_roots") or []]
    if unmounted := host.lazy_umount_under([sd, *roots, *[r / "opt" for r in roots]]):
        return [f"unmounted {len(unmounted)} mounts"]
    return []


def _clean_network(st: dict) -> list[str]:
    """The chains that appeared since start (kube-proxy's, kubelet's canaries, portmap's, ours) with the jumps to
    them, then the bridges (veths went with their network namespaces) and the route sink."""
    # Not `kube-proxy --cleanup`: besides its own chains it flushes every IPVS virtual server of the host and
    # loads ip_vs. Everything kube-proxy makes in iptables mode is a KUBE-* chain and jumps to it: removed here.
    report = []
    keep = st.get("chains_before") or []  # state files of older versions lack it: every chain is taken for ours
    if chains := host.remove_iptables_chains(keep=keep):
        names = sorted({c.split()[2] for c in chains})
        report.append(f"removed {len(chains)} iptables chains ({', '.join(names[:6])}{'...' if len(names) > 6 else ''})")
    if gone := host.delete_links([*(st.get("bridges") or []), *(st.get("links") or [])]):
        report.append(f"removed bridges {', '.join(gone)}")
    return report


def _restore_host(st: dict) -> list[str]:
    """The nodes' cgroups (their processes killed again) and the recorded sysctls."""
    report = []
    for n in st.get("names") or []:
        try:
            if removed := host.kill_cgroup_tree(n):
                report.append(f"removed cgroup /{n} ({len(removed)} dirs)")
        except RuntimeError as e:
            report.append(f"WARNING: {e}")
    if changed := host.restore_sysctls(st.get("sysctls") or {}):
        report.append("restored sysctls " + ", ".join(changed))
    return report


def _remove_paths(sd: Path, st: dict) -> list[str]:
    """What the nodes put in host paths, then the host paths that appeared with them if nothing else is in them."""
    report = []
    names = st.get("names") or []
    before = set(st.get("host_paths_before") or [])
    for n in names:
        shutil.rmtree(configs.containerd_socket(n).parent, ignore_errors=True)
    with contextlib.suppress(OSError):
        configs.RUN_DIR.rmdir()
    ours = _shim_sockets(sd, names)
    for d in LOG_LINK_DIRS:  # kubelet's links to the pod logs in the state dir
        for link in d.glob("*"):
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(str(sd) + "/"):
                    ours.append(link)
    ours += _cni_cache_files(sd, st)
    if str(KUBELET_DIR) not in before:  # else another kubelet's too
        ours.append(KUBELET_DIR / "device-plugins")
    removed = 0
    for f in ours:
        with contextlib.suppress(OSError):
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            else:
                f.unlink()
            removed += 1
    if removed:
        report.append(f"removed {removed} files of the nodes in host paths (shim sockets, log links, CNI cache)")
    for p in HOST_PATHS:
        if p in before or not os.path.lexists(p) or host.mount_points_under([p]):
            continue
        if others := [str(f) for f in Path(p).rglob("*") if not f.is_dir() or f.is_symlink()]:
            # not ours: another program made it or used it while the nodes ran
            report.append(f"kept {p}: appeared while the nodes ran but holds files they do not make "
                          f"({', '.join(others[:3])}{' ...' if len(others) > 3 else ''})")
        else:
            shutil.rmtree(p, ignore_errors=True)  # only empty directories in it
            report.append(f"removed {p}")
    return report


def _shim_sockets(sd: Path, names: Iterable[str]) -> list[Path]:
    """The shim sockets of the nodes' tasks (left behind when a shim is killed), from the task bundles in each
    node's containerd state."""
    out = []
    for n in names:
        sock = str(configs.containerd_socket(n))
        for task in (sd / n / "containerd-state" / "io.containerd.runtime.v2.task").glob("*/*"):
            digest = hashlib.sha256(f"{sock}/{task.parent.name}/{task.name}".encode()).hexdigest()
            if (SHIM_SOCKET_DIR / digest).exists():
                out.append(SHIM_SOCKET_DIR / digest)
    return out


def _cni_cache_files(sd: Path, st: dict) -> list[Path]:
    """containerd's CNI result cache of the nodes' pods (left when a pod's network was not torn down):
    ``<network>-<sandbox id>-<interface>``, the network the node's own or containerd's ``cni-loopback``, whose
    entries are told apart by the sandbox ids the nodes' containerd state and roots know."""
    names = st.get("names") or []
    ids = {p.name for n in names for p in (sd / n / "containerd-state").glob("io.containerd.runtime.v2.task/*/*")}
    ids |= {p.name for d in [*(sd / n / "containerd-state" for n in names), *map(Path, st.get("containerd_roots") or [])]
            for p in (d / "io.containerd.grpc.v1.cri" / "sandboxes").glob("*")}
    return [f for f in CNI_RESULTS_DIR.glob("*")
            if any(f.name.startswith(f"{n}-") for n in names) or any(f"-{i}-" in f.name for i in ids)]


def _delete_api_objects(control_plane: ControlPlane, names: list[str], sd: Path) -> list[str]:
    """The Node objects (a shared control plane lives on) and the PersistentVolumes provisioned under
    ``<sd>/pv``: their data is about to go, so a claim must not stay bound to them."""
    report = []
    with contextlib.suppress(Exception):
        if names:
            r = control_plane.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=false", check=False,
                                      timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                report.append(f"deleted Node objects {', '.join(names)}")
        r = control_plane.kubectl("get", "pv", "-o", "json", check=False, timeout=30)
        pv_dir = str(sd / "pv") + "/"
        pvs = [pv["metadata"]["name"] for pv in json.loads(r.stdout or "{}").get("items", [])
               if (pv["metadata"].get("annotations") or {}).get(configs.PROVISIONED_BY) == configs.PROVISIONER
               and ((pv["spec"].get("hostPath") or {}).get("path") or "").startswith(pv_dir)]
        if pvs:
            control_plane.kubectl("delete", "pv", *pvs, "--ignore-not-found", "--wait=false", check=False, timeout=30)
            report.append(f"deleted PersistentVolumes {', '.join(pvs)}")
    return report


def _remove_state_dir(sd: Path, keep_files: bool, failed: bool) -> list[str]:
    """The state dir but ``logs/``; only its state file with ``keep_files``; nothing when something of the nodes
    is left (``failed``: state.json stays for another clean_host) or mounts are below it."""
    if failed:
        return [f"WARNING: kept {sd} with its state.json for another clean-up ('python -m rljob_localcluster down')"]
    if keep_files:
        (sd / STATE_FILE).unlink(missing_ok=True)
        return []
    if host.mount_points_under([sd]):
        return [f"WARNING: still mounted below {sd}; not removed"]
    for child in sd.iterdir():
        if child.name != "logs":
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    return [f"removed {sd} (configs, kubelet and containerd state, pod logs, volume data; kept logs/)"]


def host_leftovers(names: Iterable[str] = node_names(2), state_dir: str | os.PathLike | None = None,
                   chains_before: Iterable[str] = ()) -> list[str]:
    """What local nodes could have left on the host and is there now (for tests and ``status``): cgroups,
    bridges, the route sink, CNI-*/KUBE-* chains but ``chains_before`` (as recorded in state.json), mounts
    below ``state_dir``, containerd and kubelet processes of these nodes."""
    out = []
    names = list(names)
    for n in names:
        out += [f"cgroup {d}" for d in host.cgroup_dirs(n) if d.exists()]
        i = n.rsplit("-", 1)[-1]
        if Path(f"/sys/class/net/rljob-cni{i}").exists():
            out.append(f"bridge rljob-cni{i}")
    if Path(f"/sys/class/net/{ROUTE_SINK}").exists():
        out.append(f"link {ROUTE_SINK}")
    keep = set(chains_before)
    out += [f"chain {c}" for c in host.iptables_chains() if c not in keep]
    if state_dir is not None:
        out += [f"mount {m}" for m in host.mount_points_under([state_dir])]
    for n in names:
        out += [f"process {p}" for p in host.pids_with_cmdline(f"/{n}/")
                if any(k in cmdline(p) for k in ("containerd", "kubelet"))]
    return out
