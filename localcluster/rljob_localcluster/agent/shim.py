"""Container launcher: the stand-in for runc. Standard library only; the agent runs it as
``python -I shim.py SPEC.json`` so it starts fast and imports nothing of the agent.

Steps (Linux namespaces, see namespaces(7), mount_namespaces(7), pid_namespaces(7)):
1. ``setns`` into the pod's network namespace (absent for hostNetwork pods);
2. ``unshare`` new mount, UTS and PID namespaces; make every mount private so nothing
   propagates back to the host; bind-mount each volume at its real path (read-only ones are
   remounted read-only); set the hostname (UTS);
3. fork the namespace's PID 1, a minimal init (like tini): it mounts a fresh /proc, forks the
   container command (``execvpe`` with the given env, in ``cwd``), forwards SIGTERM/SIGINT/SIGHUP/
   SIGQUIT/SIGUSR1/SIGUSR2 to it, reaps orphans, and exits with its status. When PID 1 exits the
   kernel kills every process left in the namespace, so no process of the container outlives it.

This process (outside the PID namespace) forwards the same signals to PID 1 and exits with the
container's status: its exit code, or 128 + N when signal N killed it (as container runtimes
report). Parent-death signals (SIGKILL) tie the chain to the agent thread that started it.

Spec (JSON): argv, env, cwd, hostname (null: keep the host's), netns (path or null), mounts
([{source, target, read_only}], parents first), detach (host mount points to lazily unmount in the
container's namespace after binding, so it holds no reference to other pods' network namespaces or
tmpfs volumes), parent_pid, pid1_file (gets PID 1's host pid), start_error_file (gets a message
when the sandbox or the exec fails; exit status 128 then).
"""

import ctypes
import json
import os
import signal
import socket
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG = 1
START_ERROR_EXIT = 128
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, shown=None):
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None,
        ),
        f"mount {shown or source} on {target}",
    )


def _set_pdeathsig(sig):
    _check(_libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


_dir_fds = {}


def _hold_dir(path):
    """Keep an O_PATH handle on ``path``'s directory, so :func:`_write` still reaches it after a volume
    is mounted over one of its parents (an emptyDir at /tmp while the agent's state dir is under /tmp)."""
    parent = os.path.dirname(path)
    if parent not in _dir_fds:
        _dir_fds[parent] = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _write(path, text):
    parent, name = os.path.split(path)
    dir_fd = _dir_fds.get(parent)
    tmp = name + ".tmp" if dir_fd is not None else path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    with open(fd, "w") as f:
        f.write(text)
    os.replace(tmp, name if dir_fd is not None else path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _status_code(wait_status):
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _forward_to(pid):
    def handler(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, handler)


def _ensure_target(target, source_fd):
    """Create a missing bind target of the source's type: the host made every target up front, but a
    volume mounted earlier over a parent (an emptyDir at /tmp) hides it inside the container."""
    if os.path.lexists(target):
        return
    if stat.S_ISDIR(os.fstat(source_fd).st_mode):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def mount_points_under(prefixes):
    """Mount points (deepest first) at or below any of ``prefixes``, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def setup_sandbox(spec):
    """Steps 1 and 2: network namespace, private mount + UTS + PID namespaces, mounts, hostname."""
    if spec.get("netns"):
        fd = os.open(spec["netns"], os.O_RDONLY)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns({spec['netns']})")
        finally:
            os.close(fd)
    flags = CLONE_NEWNS | CLONE_NEWPID
    if spec.get("hostname"):
        flags |= CLONE_NEWUTS
    _check(_libc.unshare(flags), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    mounts = spec.get("mounts") or []
    # Every source is opened before the first mount and bound through /proc/self/fd: a volume mounted over
    # a parent of the agent's state dir (e.g. an emptyDir at /tmp) would otherwise hide the later sources.
    sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in mounts]
    try:
        for m, fd in zip(mounts, sources, strict=True):
            _ensure_target(m["target"], fd)
            _mount(f"/proc/self/fd/{fd}", m["target"], None, MS_BIND | MS_REC, shown=m["source"])
            if m.get("read_only"):
                _mount(None, m["target"], None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    finally:
        for fd in sources:
            os.close(fd)
    for point in mount_points_under(spec.get("detach") or []):
        _libc.umount2(point.encode(), MNT_DETACH)  # best effort: a failure only keeps a reference
    if spec.get("hostname"):
        socket.sethostname(spec["hostname"])


def _exec_container(spec):
    for sig in FORWARDED + (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE; exec keeps ignored signals
    argv = spec["argv"]
    try:
        os.chdir(spec.get("cwd") or "/")
        os.execvpe(argv[0], argv, spec["env"])
    except FileNotFoundError as e:
        if e.filename == (spec.get("cwd") or "/"):
            msg = f'chdir to working dir "{e.filename}": no such file or directory'
        else:
            msg = f'exec: "{argv[0]}": executable file not found in $PATH'
    except OSError as e:
        msg = f'exec: "{argv[0]}": {e.strerror}'
    sys.stderr.write(f"rljob-shim: {msg}\n")
    sys.stderr.flush()
    _write(spec["start_error_file"], msg)
    os._exit(START_ERROR_EXIT)


def _init(spec, parent_alive):
    """PID 1 of the container's PID namespace. ``parent_alive``: read end of a pipe the outer shim holds open."""
    try:
        _set_pdeathsig(signal.SIGKILL)
        # The outer shim may have been killed between fork and prctl (no death signal would come then): its
        # end of the pipe is closed in that case. getppid() cannot tell, it is 0 in a new PID namespace.
        os.set_blocking(parent_alive, False)
        try:
            if os.read(parent_alive, 1) == b"":
                os._exit(START_ERROR_EXIT)
        except BlockingIOError:
            pass
        os.close(parent_alive)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        main_pid = os.fork()
        if main_pid == 0:
            _exec_container(spec)
        _forward_to(main_pid)
        while True:
            pid, wait_status = os.wait()
            if pid == main_pid:
                os._exit(_status_code(wait_status))
    except BaseException as e:  # noqa: BLE001 - PID 1 must never raise past here
        sys.stderr.write(f"rljob-shim: init failed: {e}\n")
        os._exit(START_ERROR_EXIT)


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != spec.get("parent_pid", os.getppid()):
        return START_ERROR_EXIT  # the agent died before the death signal was armed
    _hold_dir(spec["start_error_file"])
    _hold_dir(spec["pid1_file"])
    try:
        setup_sandbox(spec)
    except OSError as e:
        msg = f"sandbox setup failed: {e}"
        sys.stderr.write(f"rljob-shim: {msg}\n")
        _write(spec["start_error_file"], msg)
        return START_ERROR_EXIT
    parent_alive, keep_open = os.pipe()
    pid1 = os.fork()
    if pid1 == 0:
        os.close(keep_open)
        _init(spec, parent_alive)
    os.close(parent_alive)
    _forward_to(pid1)
    _write(spec["pid1_file"], str(pid1))
    _, wait_status = os.waitpid(pid1, 0)
    return _status_code(wait_status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
