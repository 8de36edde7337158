"""What the local nodes change on the host, and undoing it: sysctls, cgroups, mounts, bridges, iptables
chains, processes. Every function here is idempotent, so a ``down`` after a crash (processes killed with
SIGKILL, nothing cleaned) and a ``down`` after a clean stop run the same code.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from ..pids import pid_running

__all__ = [
    "CGROUP_ROOT",
    "SYSCTLS",
    "default_route_interface",
    "default_route_ip",
    "delete_links",
    "iptables_chains",
    "kill_cgroup_tree",
    "lazy_umount_under",
    "mount_points_under",
    "overlay_mount_works",
    "read_sysctls",
    "remove_iptables_chains",
    "restore_sysctls",
    "routes_over",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")

#: Sysctls the kubelet (setupKernelTunables), kube-proxy and the CNI bridge plugin (ip_forward) may change;
#: recorded before the first process starts and written back by ``down``.
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.forwarding",
    "net.ipv4.conf.all.route_localnet",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)

_MNT_DETACH = 2


def run(cmd: list[str], check: bool = False, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with text output captured (``input`` on its stdin). Raises CalledProcessError when
    ``check`` and it fails, subprocess.TimeoutExpired after ``timeout`` seconds."""
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout, input=input)


# ---------------------------------------------------------------------------------------------------- addresses
def default_route_ip() -> str:
    """The IPv4 address of the interface that holds the default route (what pods and kubelets reach the
    API server and CoreDNS on). Raises RuntimeError when there is no IPv4 default route or its interface
    has no IPv4 address."""
    try:
        dev = default_route_interface()
    except RuntimeError:
        raise RuntimeError("no IPv4 default route: cannot tell the host address pods should reach") from None
    out = run(["ip", "-4", "-o", "addr", "show", "dev", dev], check=True).stdout
    m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if not m:
        raise RuntimeError(f"interface {dev} (default route) has no IPv4 address")
    return m.group(1)


# ---------------------------------------------------------------------------------------------------- sysctls
def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls(names: Iterable[str] = SYSCTLS) -> dict[str, str]:
    """{name: value} of those that exist."""
    out = {}
    for n in names:
        try:
            out[n] = _sysctl_path(n).read_text().strip()
        except OSError:
            pass
    return out


def restore_sysctls(values: dict[str, str]) -> list[str]:
    """Write back recorded values; returns "name: now -> recorded" for each one that had changed."""
    changed = []
    for n, v in values.items():
        p = _sysctl_path(n)
        try:
            now = p.read_text().strip()
            if now != v:
                p.write_text(v)
                changed.append(f"{n}: {now} -> {v}")
        except OSError:
            pass
    return changed


# ---------------------------------------------------------------------------------------------------- processes
def pids_with_cmdline(*parts: str) -> list[int]:
    """Pids whose command line contains every one of ``parts`` (e.g. a containerd shim's ``-address <sock>``)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid() and pid_running(int(d.name), *parts):
            found.append(int(d.name))
    return found


# ---------------------------------------------------------------------------------------------------- cgroups
def cgroup_dirs(name: str) -> list[Path]:
    """``/sys/fs/cgroup/<hierarchy>/<name>`` for every mounted hierarchy (v1 controllers, named and unified)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # cgroup v2 only: one hierarchy at the root
        return [CGROUP_ROOT / name]
    if not CGROUP_ROOT.is_dir():
        return []
    # cgroup v1 (and hybrid): one mounted hierarchy per controller set, plus name=systemd and unified
    return [h / name for h in sorted(CGROUP_ROOT.iterdir()) if os.path.ismount(h) and (h / "cgroup.procs").exists()]


def make_cgroup(name: str) -> list[Path]:
    """Create ``/<name>`` in every hierarchy (kubelet's cgroupRoot must exist); cpuset gets its parent's
    cpus and mems so that tasks can join it. Returns the dirs created."""
    made = []
    for d in cgroup_dirs(name):
        if not d.exists():
            d.mkdir()
            made.append(d)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (d / f).exists() and not (d / f).read_text().strip():
                (d / f).write_text((d.parent / f).read_text().strip() or "0")
    return made


def kill_cgroup_tree(name: str, timeout: float = 20.0, remove: bool = True) -> list[str]:
    """SIGKILL every process in the ``/<name>`` cgroups of every hierarchy, then (``remove``) remove those
    cgroups deepest first, retrying for up to ``timeout`` seconds while processes die. Returns the cgroup dirs
    removed. Raises RuntimeError naming the cgroups still there after ``timeout``."""
    removed: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        tops = [d for d in cgroup_dirs(name) if d.exists()]
        if not tops:
            return removed
        dirs = sorted({p for t in tops for p in [t, *[q for q in t.rglob("*") if q.is_dir()]]},
                      key=lambda p: len(p.parts), reverse=True)
        for d in dirs:
            if (d / "freezer.state").exists():
                try:
                    (d / "freezer.state").write_text("THAWED")
                except OSError:
                    pass
            try:
                pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not remove:
            return removed
        for d in dirs:
            try:
                d.rmdir()
                removed.append(str(d))
            except FileNotFoundError:
                pass
            except OSError:
                pass  # still has processes (dying) or children: next round
        if time.monotonic() > deadline:
            left = [str(d) for d in dirs if d.exists()]
            if left:
                raise RuntimeError(f"cgroups not removable (processes do not die?): {', '.join(left[:5])}")
            return removed
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------------- mounts
def overlay_mount_works(parent: str | os.PathLike) -> bool:
    """Whether an overlay mount works in a temporary dir under ``parent`` (containerd's overlayfs snapshotter
    needs that of its root's filesystem)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".overlay-check-") as t:
        for d in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(t, d))
        opts = f"lowerdir={t}/lower,upperdir={t}/upper,workdir={t}/work".encode()
        if libc.mount(b"overlay", f"{t}/merged".encode(), b"overlay", 0, opts) == 0:
            libc.umount2(f"{t}/merged".encode(), _MNT_DETACH)
            return True
    return False


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mount_points_under(roots: Iterable[str | os.PathLike]) -> list[str]:
    """Mount points at or below any of ``roots`` (resolved), deepest first."""
    rs = [os.path.realpath(r) for r in roots]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = _unescape(line.split()[4])
        if any(mp == r or mp.startswith(r.rstrip("/") + "/") for r in rs):
            found.append(mp)
    return sorted(dict.fromkeys(found), key=lambda p: p.count("/"), reverse=True)


def lazy_umount_under(roots: Iterable[str | os.PathLike]) -> list[str]:
    """Detach (``umount -l``) every mount below ``roots``, deepest first, until none is left."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    done: list[str] = []
    roots = list(roots)
    for _ in range(10):
        mps = mount_points_under(roots)
        if not mps:
            break
        for mp in mps:
            if libc.umount2(mp.encode(), _MNT_DETACH) == 0:
                done.append(mp)
    return done


# ---------------------------------------------------------------------------------------------------- network
def delete_links(names: Iterable[str]) -> list[str]:
    """``ip link delete`` each existing link; returns those deleted."""
    gone = []
    for n in names:
        if Path(f"/sys/class/net/{n}").exists() and run(["ip", "link", "delete", n]).returncode == 0:
            gone.append(n)
    return gone


def add_route_sink(link: str, cidrs: Iterable[str]) -> None:
    """A port-less bridge ``link`` that holds routes for ``cidrs`` (the Service and pod ranges): packets to an
    address there that no kube-proxy rule or node bridge claims end on this link (nothing answers there)
    instead of leaving the host by its default route. Locally sent packets still reach ClusterIPs
    (kube-proxy's DNAT re-routes them). A bridge, not a dummy link: kernels without the dummy module exist."""
    if not Path(f"/sys/class/net/{link}").exists():
        run(["ip", "link", "add", link, "type", "bridge"], check=True)
    run(["ip", "link", "set", link, "up"], check=True)
    for c in cidrs:  # add, not replace: routes_over() checked that no route of the host is there
        run(["ip", "route", "add", c, "dev", link], check=True)


def routes_over(cidr: str) -> list[str]:
    """Routes of the main table, but the default route, that cover ``cidr`` or lie inside it (a VPN's or a
    container network's): each one as ``ip route`` prints it."""
    out = []
    for sel in ("match", "root"):
        for line in run(["ip", "-4", "route", "show", sel, cidr], check=True).stdout.splitlines():
            if (line := line.strip()) and not line.startswith("default") and line not in out:
                out.append(line)
    return out


def reject_forwarding_out(chain: str, source: str, out_interface: str) -> None:
    """Reject forwarded packets from ``source`` (the pods) that would leave by ``out_interface`` (the host's
    uplink): the pods talk to each other, to Services and to this host only. In its own chain ``chain``,
    jumped to from FORWARD."""
    run(["iptables", "-N", chain])
    run(["iptables", "-F", chain], check=True)
    run(["iptables", "-A", chain, "-s", source, "-o", out_interface, "-j", "REJECT"], check=True)
    if run(["iptables", "-C", "FORWARD", "-j", chain]).returncode != 0:
        run(["iptables", "-I", "FORWARD", "1", "-j", chain], check=True)


def default_route_interface() -> str:
    """The interface of the IPv4 default route (from /proc/net/route). Raises RuntimeError when there is none."""
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) > 3 and f[1] == "00000000" and int(f[3], 16) & 2:
            return f[0]
    raise RuntimeError("no IPv4 default route")


def remove_iptables_chains(prefixes: Iterable[str] = ("CNI-", "KUBE-"), keep: Iterable[str] = ()) -> list[str]:
    """Remove the iptables/ip6tables chains whose name starts with one of ``prefixes`` in every table, but those
    in ``keep`` ("<cmd> <table> <chain>" as :func:`iptables_chains` gives them: the chains that were there
    before the nodes started), with the rules of other chains that jump to a removed one. Returns
    "<cmd> <table> <chain>" of each chain removed."""
    prefixes, keep = tuple(prefixes), set(keep)
    removed = []
    for binary in ("iptables", "ip6tables"):
        save = run([f"{binary}-save"])
        if save.returncode != 0:
            continue
        table = None
        chains: dict[str, list[str]] = {}
        rules: dict[str, list[tuple[str, str, str]]] = {}  # (owner, target, "-A ..." line)
        for line in save.stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
                chains.setdefault(table, [])
                rules.setdefault(table, [])
            elif line.startswith(":") and table:
                name = line[1:].split()[0]
                if name.startswith(prefixes) and f"{binary} {table} {name}" not in keep:
                    chains[table].append(name)
            elif line.startswith("-A ") and table:
                f = shlex.split(line)  # a --comment "with spaces" is one word
                target = f[f.index("-j") + 1] if "-j" in f else (f[f.index("-g") + 1] if "-g" in f else "")
                rules[table].append((f[1], target, line))
        for t, names in chains.items():
            gone = set(names)
            jumps = ["-D" + line[2:] for owner, target, line in rules.get(t, []) if target in gone and owner not in gone]
            if not names:
                continue
            script = [f"*{t}", *jumps, *[f"-F {c}" for c in names], *[f"-X {c}" for c in names], "COMMIT", ""]
            r = run([f"{binary}-restore", "--noflush"], input="\n".join(script))
            if r.returncode != 0:  # one rule at a time, so that one odd rule does not keep the rest
                for rule in jumps:
                    run([binary, "-t", t, *shlex.split(rule)])
                for c in names:
                    run([binary, "-t", t, "-F", c])
                for c in names:
                    run([binary, "-t", t, "-X", c])
            left = run([f"{binary}-save", "-t", t]).stdout
            removed += [f"{binary} {t} {c}" for c in names if f":{c} " not in left]
    return removed


def iptables_chains(prefixes: Iterable[str] = ("CNI-", "KUBE-")) -> list[str]:
    """Chains with those prefixes now present in iptables and ip6tables ("<cmd> <table> <chain>")."""
    prefixes = tuple(prefixes)
    out = []
    for binary in ("iptables", "ip6tables"):
        table = None
        for line in run([f"{binary}-save"]).stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and line[1:].split()[0].startswith(prefixes):
                out.append(f"{binary} {table} {line[1:].split()[0]}")
    return out
