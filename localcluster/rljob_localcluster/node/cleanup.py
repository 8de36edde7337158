"""Host bookkeeping of the local nodes: the state file (pids, recorded sysctls, what existed before), the
host-wide lock, and undoing everything the nodes did (:func:`clean_host`, also after a crash)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from . import configs, host

if TYPE_CHECKING:
    from ..controlplane import ControlPlane

__all__ = ["EGRESS_CHAIN", "HOST_LOCK", "HOST_PATHS", "ROUTE_SINK", "NodesError", "clean_host", "host_leftovers",
           "node_names"]


class NodesError(RuntimeError):
    """The local nodes could not start or be cleaned (the message says why)."""


def node_names(count: int = 2) -> list[str]:
    return [f"rljob-node-{i}" for i in range(count)]


HOST_LOCK = Path("/run/rljob-local-nodes.lock")
#: Host paths the kubelet, containerd or the CNI plugins create when missing (hard-coded there); a path that
#: did not exist before start is removed by clean_host.
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/containerd",
              "/var/run/netns", "/usr/libexec/kubernetes", "/etc/cni", "/opt/cni")
#: Port-less bridge holding the routes of the Service and pod ranges (see host.add_route_sink).
ROUTE_SINK = "rljob-sink0"
#: filter chain that keeps pods' packets from leaving by the host's uplink (removed with the CNI-* chains).
EGRESS_CHAIN = "CNI-RLJOB-HOST-ONLY"


# ==================================================================================================== state file
def _read_state(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_state(state_dir: Path, st: dict) -> None:
    tmp = state_dir / "state.json.tmp"
    tmp.write_text(json.dumps(st, indent=2))
    tmp.replace(state_dir / "state.json")


class _HostLock:
    """One set of local nodes per host (bridges, cgroup names, kube-proxy's chains are host-wide)."""

    def __init__(self) -> None:
        self.fd: IO[str] | None = None

    def acquire(self, state_dir: Path) -> None:
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
    ``state.json`` alone: their processes (recorded pids whose command line still names this run), the
    containerd shims of their sockets, every process left in the ``/rljob-node-<i>`` cgroups (containers),
    kube-proxy's rules (``kube-proxy --cleanup``) and every CNI-*/KUBE-* iptables chain, mounts below the
    state dir and the containerd roots (lazily, deepest first), the bridges, the cgroups, the host paths
    that did not exist before (``/var/lib/kubelet`` ...), the sysctls (written back as recorded), and the
    state dir but for ``logs/``; with a reachable ``control_plane`` also the Node objects. Returns one line
    per thing removed. The containerd roots (image cache) are kept."""
    sd = Path(state_dir).resolve()
    say = log or (lambda m: None)
    st = _read_state(sd)
    if not st:
        return []
    if not locked and not _lock_is_free():
        raise NodesError(f"local nodes still run on this host ({HOST_LOCK}); stop their owner first")
    report: list[str] = []
    names = st.get("names") or []
    roots = [Path(r) for r in st.get("containerd_roots") or []]

    # 1. processes: the recorded ones (kubelets, kube-proxy, CoreDNS, controller, then containerd)
    recorded = st.get("pids") or {}
    non_ctd = [(v["pid"], v["marks"]) for k, v in recorded.items() if not k.startswith("containerd-")]
    if ended := host.terminate_pids(non_ctd, 20):
        report.append(f"ended processes {ended}")
    # 2. containers: everything in the nodes' cgroups (pods' processes), before their shims go
    for n in names:
        with contextlib.suppress(RuntimeError):
            host.kill_cgroup_tree(n, timeout=0.5, remove=False)  # kill only; removal below
    ctd = [(v["pid"], v["marks"]) for k, v in recorded.items() if k.startswith("containerd-")]
    if ended := host.terminate_pids(ctd, 20):
        report.append(f"ended containerd {ended}")
    shims = []
    for n in names:
        sock = str(configs.containerd_socket(n))
        shims += [(p, ("containerd-shim", sock)) for p in host.pids_with_cmdline("containerd-shim", sock)]
    if ended := host.terminate_pids(shims, 5):
        report.append(f"ended containerd shims {ended}")

    # 3. iptables: kube-proxy's own cleanup, then every CNI-* / KUBE-* chain left (kubelet's canaries, portmap)
    kp = Path(st.get("bin_dir") or "") / "kube-proxy"
    if kp.exists():
        subprocess.run([str(kp), "--cleanup", "--v=0"], capture_output=True, timeout=60, check=False)
    if chains := host.remove_iptables_chains():
        report.append(f"removed {len(chains)} iptables chains ({', '.join(sorted({c.split()[2] for c in chains})[:6])}...)")

    # 4. mounts (netns bind mounts, rootfs overlays, kubelet volumes), deepest first
    if unmounted := host.lazy_umount_under([sd, *roots, *[r / "opt" for r in roots]]):
        report.append(f"unmounted {len(unmounted)} mounts")

    # 5. bridges (veths went with their network namespaces) and the route sink
    if gone := host.delete_links([*(st.get("bridges") or []), *(st.get("links") or [])]):
        report.append(f"removed bridges {', '.join(gone)}")

    # 6. cgroups
    for n in names:
        try:
            if removed := host.kill_cgroup_tree(n):
                report.append(f"removed cgroup /{n} ({len(removed)} dirs)")
        except RuntimeError as e:
            report.append(f"WARNING: {e}")

    # 7. sysctls
    if changed := host.restore_sysctls(st.get("sysctls") or {}):
        report.append("restored sysctls " + ", ".join(changed))

    # 8. host paths the kubelet/containerd/CNI made; links and results of ours in those that existed
    before = set(st.get("host_paths_before") or [])
    for p in HOST_PATHS:
        if p not in before and os.path.lexists(p):
            if not host.mount_points_under([p]):
                shutil.rmtree(p, ignore_errors=True)
                report.append(f"removed {p}")
    for n in names:
        shutil.rmtree(configs.containerd_socket(n).parent, ignore_errors=True)
    with contextlib.suppress(OSError):
        configs.RUN_DIR.rmdir()
    if "/var/log/containers" in before:
        for link in Path("/var/log/containers").glob("*.log"):
            with contextlib.suppress(OSError):
                if os.readlink(link).startswith(str(sd) + "/"):
                    link.unlink()
    if "/var/lib/cni" in before:
        for n in names:
            for f in Path("/var/lib/cni/results").glob(f"{n}-*"):
                f.unlink(missing_ok=True)

    # 9. the Node objects (a shared control plane lives on)
    if control_plane is not None and names:
        with contextlib.suppress(Exception):
            r = control_plane.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=false", check=False,
                                      timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                report.append(f"deleted Node objects {', '.join(names)}")

    # 10. the state dir but logs/
    if not keep_files:
        if host.mount_points_under([sd]):
            report.append(f"WARNING: still mounted below {sd}; not removed")
        else:
            for child in sd.iterdir():
                if child.name != "logs":
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            report.append(f"removed {sd} (configs, kubelet and containerd state, pod logs, volume data; kept logs/)")
    else:
        (sd / "state.json").unlink(missing_ok=True)
    for line in report:
        say(line)
    return report


def host_leftovers(names: Iterable[str] = node_names(2), state_dir: str | os.PathLike | None = None) -> list[str]:
    """What local nodes could have left on the host and is there now (for tests and ``status``)."""
    out = []
    names = list(names)
    for n in names:
        out += [f"cgroup {d}" for d in host.cgroup_dirs(n) if d.exists()]
        i = n.rsplit("-", 1)[-1]
        if Path(f"/sys/class/net/rljob-cni{i}").exists():
            out.append(f"bridge rljob-cni{i}")
    if Path(f"/sys/class/net/{ROUTE_SINK}").exists():
        out.append(f"link {ROUTE_SINK}")
    out += [f"chain {c}" for c in host.iptables_chains()]
    if state_dir is not None:
        out += [f"mount {m}" for m in host.mount_points_under([state_dir])]
    for n in names:
        out += [f"process {p}" for p in host.pids_with_cmdline(f"/{n}/")
                if any(k in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors='replace')
                       for k in ("containerd", "kubelet"))]
    return out

