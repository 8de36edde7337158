"""rljob's streaming pipeline as processes on this machine, for the learning benchmarks (time_to_reward.py,
learning_robustness.py, learning_curve.py, environment_learning.py): the pods of a CPU job without Kubernetes, as tests/rollout/test_learn.py
runs them.

:func:`run_pipeline` starts a throw-away redis-server (no password, nothing on disk), writes the resolved config of a
spec, then ``torchrun --nproc-per-node=2 -m rljob_trainer.train`` (the trainer's 2 data-parallel gloo ranks: the
example's 2 pods × 1 process, on one node here) and one ``python -m rljob_rollout`` per rollout replica. Every process
runs with ``OMP_NUM_THREADS=1`` and, given ``cores``, under ``taskset -c cores``. While they run it polls the rollout
hash (:func:`rljob_api.protocol.rewards_by_version`) every ``poll_s`` and notes when each weights version's reward
first appeared (:class:`RewardWatch`); the rollout hash keeps only the newest 128 versions, so this record is the
whole curve. A job with ``spec.rollout.environment.server`` (multi-turn episodes, docs/environments.md) gets its
environment server as one more local process, as the operator would run it (:func:`environment_server_command`), and
the rollout replicas reach it by ``environment.url``. It stops at ``maxSteps`` (exit of the trainer) or as soon as ``stop_when`` says so, and kills whatever is
left (by pid, descendants included), also on an error or Ctrl-C.

The pure parts (the reward record, the spec of the CPU example, the thresholds) are tested in
tests/rollout/test_learning_bench.py, the environment server's command and the metric reading in
tests/rollout/test_environment_learning_bench.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The packages a learning run's processes import (api, the wire between pods, trainer, rollout).
SOURCE_FOLDERS = ("api", "wire", "trainer", "rollout")
EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
TRAINER_PROCESSES = 2
"""Data-parallel ranks of the trainer: the CPU example's 2 pods × 1 process."""


@dataclass(frozen=True)
class Point:
    """One weights version's rollout reward.

    Attributes:
        version: the weights version (documents the trainer had trained on when it published them).
        step: the optimizer step that produced them (version // documentsPerStep; 0 = the initial weights).
        reward: mean reward of every sample generated with them (all replicas), as last read.
        samples: how many samples that mean is over.
        seconds: when the reward of this version first appeared, seconds since the processes were launched.
    """

    version: int
    step: int
    reward: float
    samples: int
    seconds: float


class RewardWatch:
    """The rollout reward per weights version as it appears in the rollout hash (pure; fed by :func:`run_pipeline`).

    Args:
        documents_per_step: spec.trainer.batch.documentsPerStep (turns versions into steps).
    """

    def __init__(self, documents_per_step: int) -> None:
        if documents_per_step < 1:
            raise ValueError(f"documents_per_step={documents_per_step}: must be >= 1")
        self.documents_per_step = documents_per_step
        self._points: dict[int, Point] = {}

    def update(self, rewards: dict[int, tuple[float, int]], seconds: float) -> None:
        """Take one reading of :func:`rljob_api.protocol.rewards_by_version` made ``seconds`` after the launch: new
        versions are noted with this time, known ones keep their first time and take the latest mean and count."""
        for version, (reward, samples) in rewards.items():
            first = self._points.get(version)
            self._points[version] = Point(version, version // self.documents_per_step, reward, samples,
                                          first.seconds if first else seconds)

    @property
    def points(self) -> list[Point]:
        """Every version seen so far, ascending."""
        return [self._points[v] for v in sorted(self._points)]


def first_reaching(points: Iterable[Point], threshold: float) -> Optional[Point]:
    """The earliest version (by the time it appeared, then by version) whose reward is >= ``threshold``, or None."""
    reached = [p for p in points if p.reward >= threshold]
    return min(reached, key=lambda p: (p.seconds, p.version)) if reached else None


def example_spec(path: Path = EXAMPLE) -> dict[str, Any]:
    """The ``spec`` of the RLTrainingJob in ``path`` (the CPU example), as a plain dict (a fresh copy).

    Raises:
        ValueError: the file holds no RLTrainingJob.
    """
    for document in yaml.safe_load_all(path.read_text()):
        if document and document.get("kind") == "RLTrainingJob":
            return copy.deepcopy(document["spec"])
    raise ValueError(f"{path}: no RLTrainingJob in it")


def local_spec(spec: dict[str, Any], *, seed: int, replicas: int = 1, max_steps: Optional[int] = None,
               overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``spec`` made runnable as local processes: the trainer on one node with :data:`TRAINER_PROCESSES` ranks (the same
    data-parallel size as the example's 2 pods), no checkpoint claim, ``trainer.seed`` = ``rollout.seed`` = ``seed``,
    ``replicas`` rollout replicas, ``max_steps`` if given, then ``overrides`` merged in (nested dicts merge, other
    values replace). ``spec`` itself is not changed."""
    out = copy.deepcopy(spec)
    trainer, rollout = out.setdefault("trainer", {}), out.setdefault("rollout", {})
    trainer.update(nodes=1, processesPerNode=TRAINER_PROCESSES, seed=seed)
    trainer.get("checkpoint", {}).pop("volume", None)
    rollout.update(seed=seed, replicas=replicas)
    if max_steps is not None:
        trainer["maxSteps"] = max_steps
    return merge(out, overrides or {})


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in place: nested dicts merge key by key, anything else replaces. Returns ``base``."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


@dataclass
class PipelineRun:
    """What one :func:`run_pipeline` saw.

    Attributes:
        points: the rollout reward of every weights version (:class:`RewardWatch`).
        steps: the trainer's per-step JSON lines (rank 0's stdout; ``step``, ``metrics`` with ``staleness`` ...).
        seconds: wall time from the launch to the end (seconds).
        returncode: the trainer's exit status; None when it was stopped early (``stop_when``) or timed out.
        stopped_early: ``stop_when`` ended the run.
        timed_out: ``timeout_s`` ended the run.
        log_dir: where the processes' logs are.
        extra: ``cpu_seconds`` — CPU seconds (user + system) of the trainer (torchrun and its ranks) and of each rollout
            process from the first poll that saw a scored batch to the last poll before the end (start-up, mostly
            imports, left out), and ``steps_at_cpu``, the trainer steps reported in between (0, and no CPU
            seconds, when no step was).
    """

    points: list[Point]
    steps: list[dict[str, Any]]
    seconds: float
    returncode: Optional[int]
    stopped_early: bool
    timed_out: bool
    log_dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the per-step lines are left out: they are in the trainer's log)."""
        out = asdict(self)
        out.pop("steps")
        return out


def start_redis() -> tuple[subprocess.Popen, int, str]:
    """A redis-server on a free loopback port with no password and nothing on disk; returns (process, port, data dir).

    Raises:
        SystemExit: no redis-server on PATH, or it did not answer within 10 s.
    """
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    data_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"rljob-learn-redis-{port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return process, port, str(data_dir)
        except redis.ConnectionError:
            if process.poll() is not None:
                break
            time.sleep(0.05)
    process.kill()
    raise SystemExit("redis-server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> str:
    """The python of vLLM's venv (scripts/vllm-venv.sh, built on first use: about 4 minutes).

    Raises:
        subprocess.CalledProcessError: the venv could not be built.
    """
    out = subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh")], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


ENVIRONMENT_READY_S = 120.0
"""Longest wait for a local environment server's ``/health`` (seconds): its start is mostly imports (FastAPI, gradio)."""


def environment_server_command(server: dict[str, Any], port: int) -> list[str]:
    """The command of ``spec.rollout.environment.server`` (camelCase dict) as a local process on ``port``: its
    ``command`` + ``args`` (an image's default entrypoint cannot be run here: ``command`` is required), ``python`` as
    this interpreter, then ``--host 127.0.0.1 --port <port>`` (later options win in argparse, so these replace the
    manifest's; rljob's ``python -m rljob_rollout.environments.serve`` takes both).

    Raises:
        ValueError: the server has no ``command``.
    """
    command = [*server.get("command", []), *server.get("args", [])]
    if not server.get("command"):
        raise ValueError("spec.rollout.environment.server.command: needed to run the server as a local process")
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    return [*command, "--host", "127.0.0.1", "--port", str(port)]


def rollout_metrics(work_dir: Path, replica: int = 0, timeout_s: float = 2.0) -> Optional[str]:
    """The Prometheus text of rollout replica ``replica`` of a :func:`run_pipeline` in ``work_dir`` (its port is the
    one its log names: ``metrics port N``), or None when it has not logged it yet or does not answer."""
    import re
    import urllib.request

    log = work_dir / f"rollout-{replica}.stderr"
    found = re.search(r"metrics port (\d+)", log.read_text()) if log.exists() else None
    if found is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=timeout_s) as answer:
            return answer.read().decode()
    except OSError:
        return None


def metric_value(text: str, name: str) -> Optional[float]:
    """The value of the unlabelled sample ``name`` (``rljob_rollout_episode_turns_sum``) in Prometheus text, or
    None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the environment server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the environment server did not answer {url}/health within {timeout_s:.0f} s")


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*(str(REPO / folder) for folder in SOURCE_FOLDERS), env.get("PYTHONPATH", "")])
    return env


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the option in its error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds)."""
    value = float(text)
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def reward_level(text: str) -> float:
    """An argparse type: a rollout reward level in (0, 1] (the digit tasks' rewards lie in [0, 1], so a level above 1
    is never reached and one at or below 0 is reached by any run)."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a rollout reward in (0, 1] (the task's rewards lie in [0, 1]), "
                                         f"got {text}")
    return value


def parse_cores(text: str) -> set[int]:
    """The cores of a ``taskset -c`` list (``"0,1"``, ``"0-3,6"``).

    Raises:
        ValueError: not such a list.
    """
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if first > last:
            raise ValueError(part)
        cores.update(range(first, last + 1))
    return cores


def core_list(text: str) -> str:
    """An argparse type: a ``taskset -c`` list (``"0,1"``, ``"0-3,6"``) of cores this process may use, returned as it
    is."""
    allowed = os.sched_getaffinity(0)
    try:
        cores = parse_cores(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a taskset -c list such as 0,1 or 0-3,6, got {text!r}") from None
    if not cores <= allowed:
        raise argparse.ArgumentTypeError(f"{text!r} names cores this process may not use (allowed: "
                                         f"{','.join(map(str, sorted(allowed)))})")
    return text


def pinned(command: list[str], cores: Optional[str]) -> list[str]:
    """``command`` under ``taskset -c cores`` (its children inherit the affinity), or as it is when ``cores`` is None."""
    return ["taskset", "-c", cores, *command] if cores else command


def require_psutil() -> None:
    """Exit with status 2 (an error, as the benchmarks' other errors), naming the extra to install, when psutil (the
    process trees) is missing."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("the learning benchmarks need psutil: scripts/install-dev.sh test,benchmark", file=sys.stderr)
        raise SystemExit(2) from None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (psutil); 0 for a process that is gone."""
    import psutil

    total = 0.0
    try:
        processes = [psutil.Process(pid)]
        processes += processes[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return total
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def stop_on_signals() -> None:
    """Make SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, so that a sweep started in the background
    (where the shell leaves SIGINT ignored) or stopped with ``kill`` ends its runs, kills their processes and keeps
    its results file, as Ctrl-C does."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every descendant of it (torchrun puts its workers in sessions of their own, so a process
    group kill would miss them), then reap it."""
    import psutil

    if process.poll() is None:
        try:
            tree = [psutil.Process(process.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for member in tree:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass


def run_pipeline(
    spec: dict[str, Any],
    work_dir: Path,
    *,
    cores: Optional[str] = None,
    stop_when: Optional[Callable[[list[Point]], bool]] = None,
    timeout_s: float = 1800,
    poll_s: float = 0.25,
    echo: Optional[Callable[[str], None]] = None,
    rollout_python: Optional[str] = None,
) -> PipelineRun:
    """Run the trainer and the rollout replicas of ``spec`` (a :func:`local_spec`) until the trainer exits, ``stop_when``
    (called with the points after every poll) returns True, or ``timeout_s`` passes; see the module docstring.

    Args:
        spec: the RLTrainingJob spec (camelCase dict).
        work_dir: created if missing; holds the config, the checkpoints and the logs.
        cores: a ``taskset -c`` list (``"0,1"``) for every process; None: no pinning.
        echo: called with a progress line now and then (None: quiet).
        rollout_python: the rollout replicas' Python (None: this one); the ``vllm`` backend's is vLLM's own venv
            (scripts/vllm-venv.sh), whose torch is the trainer's.

    Raises:
        pydantic.ValidationError: ``spec`` is not a valid RLTrainingJob spec.
        RuntimeError: a rollout process exited with an error before the trainer finished (its log tail included), or
            the environment server did not start.
    """
    import redis

    from rljob_api import protocol
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    require_psutil()
    work_dir.mkdir(parents=True, exist_ok=True)
    RLTrainingJobSpec.model_validate(spec)
    server = (spec["rollout"].get("environment") or {}).get("server")
    environment_port = free_port() if server else None
    if server:  # the rollout replicas reach the local server by url, as they would a server outside the job
        spec = copy.deepcopy(spec)
        spec["rollout"]["environment"].pop("server")
        spec["rollout"]["environment"]["url"] = f"http://127.0.0.1:{environment_port}"
    parsed = RLTrainingJobSpec.model_validate(spec)
    redis_process, port, redis_dir = start_redis()
    processes: list[subprocess.Popen] = []
    logs: list[Any] = []
    try:
        config = resolve("bench", "local", parsed, RedisConnection(host="127.0.0.1", port=port))
        config = config.model_copy(update={"checkpoint_dir": str(work_dir / "checkpoints"), "metrics_port": 0,
                                           "trainer_master_host": "127.0.0.1", "weights_port": free_port()})
        config_path = work_dir / "config.json"
        config_path.write_text(config.to_json())
        env = dict(_environment(), RLJOB_CONFIG=str(config_path))
        watch = RewardWatch(parsed.trainer.batch.documents_per_step)
        client = redis.Redis(port=port)

        def launch(command: list[str], name: str, **extra_env: str) -> subprocess.Popen:
            out = open(work_dir / f"{name}.stdout", "w")
            err = open(work_dir / f"{name}.stderr", "w")
            logs.extend([out, err])
            process = subprocess.Popen(pinned(command, cores), env=dict(env, **extra_env), stdout=out, stderr=err,
                                       start_new_session=True, cwd=work_dir)
            processes.append(process)
            return process

        if server:
            environment_server = launch(environment_server_command(server, environment_port), "environment")
            _wait_healthy(parsed.rollout.environment.url, environment_server, work_dir / "environment.stderr",
                          ENVIRONMENT_READY_S)
        started = time.monotonic()
        trainer = launch([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                          f"--nproc-per-node={TRAINER_PROCESSES}", "--master-addr=127.0.0.1",
                          f"--master-port={free_port()}", "-m", "rljob_trainer.train"], "trainer")
        rollouts = [launch([rollout_python or sys.executable, "-m", "rljob_rollout"], f"rollout-{i}", RLJOB_REPLICA_INDEX=str(i))
                    for i in range(parsed.rollout.replicas)]
        stopped = timed_out = False
        last_echo = 0.0
        cpu: dict[str, float] = {}
        first: Optional[tuple[dict[str, float], int]] = None  # (CPU seconds, trainer step) at the first scored batch
        last: Optional[tuple[dict[str, float], int]] = None  # the same at the last poll
        while True:
            now = time.monotonic() - started
            watch.update(protocol.rewards_by_version(client.hgetall(config.keys.rollout)), now)
            if trainer.poll() is not None:
                break
            cpu = {"trainer": cpu_seconds(trainer.pid),
                   **{f"rollout-{i}": cpu_seconds(r.pid) for i, r in enumerate(rollouts)}}
            # A process of a tree that ended takes its CPU seconds with it: such a reading is not a later one.
            if watch.points and (last is None or all(cpu[name] >= last[0].get(name, 0.0) for name in cpu)):
                last = (cpu, int(client.hget(config.keys.progress, protocol.PROGRESS_STEP) or 0))
                first = first or last
            for index, rollout in enumerate(rollouts):
                if rollout.poll() not in (None, 0):
                    tail = (work_dir / f"rollout-{index}.stderr").read_text()[-3000:]
                    raise RuntimeError(f"rollout {index} exited with {rollout.returncode}:\n{tail}")
            if stop_when is not None and stop_when(watch.points):
                stopped = True
                break
            if now > timeout_s:
                timed_out = True
                break
            if echo is not None and now - last_echo >= 15 and watch.points:
                last = watch.points[-1]
                echo(f"  {now:5.0f} s  step {last.step:4d}  rollout reward {last.reward:.3f}")
                last_echo = now
            time.sleep(poll_s)
        seconds = time.monotonic() - started
        returncode = trainer.returncode if not (stopped or timed_out) else None
        if returncode == 0:  # the rollout workers see training_finished and exit 0; give them a moment
            for rollout in rollouts:
                try:
                    rollout.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            watch.update(protocol.rewards_by_version(client.hgetall(config.keys.rollout)), seconds)
    finally:
        for process in processes:
            kill_tree(process)
        for log in logs:
            log.close()
        redis_process.terminate()
        try:
            redis_process.wait(10)
        except subprocess.TimeoutExpired:
            redis_process.kill()
        shutil.rmtree(redis_dir, ignore_errors=True)
    steps = [json.loads(line) for line in (work_dir / "trainer.stdout").read_text().splitlines() if line.startswith("{")]
    spent: dict[str, Any] = {"cpu_seconds": {}, "steps_at_cpu": 0}
    if first is not None and last is not None and last[1] > first[1]:
        spent = {"cpu_seconds": {name: last[0][name] - first[0].get(name, 0.0) for name in last[0]},
                 "steps_at_cpu": last[1] - first[1]}
    return PipelineRun(watch.points, steps, seconds, returncode, stopped, timed_out, str(work_dir), spent)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``os.getloadavg`` gives them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(frozen=True)
class Steadiness:
    """How steady one core's speed is (:func:`cpu_steadiness`): milliseconds per chunk of the same pure-Python loop.

    Attributes:
        fastest_ms, median_ms, p90_ms: the fastest chunk, the median and the 90th percentile (milliseconds).
    """

    fastest_ms: float
    median_ms: float
    p90_ms: float

    @property
    def swing(self) -> float:
        """p90 / fastest: 1.0 on a steady core; 2.0 when one chunk in ten ran at half the fastest one's speed."""
        return self.p90_ms / self.fastest_ms

    def __str__(self) -> str:
        return (f"one core's speed: fastest {self.fastest_ms:.1f} ms, median {self.median_ms:.1f}, p90 {self.p90_ms:.1f} "
                f"per chunk (swing {self.swing:.2f})")


def cpu_steadiness(chunks: int = 40, iterations: int = 300_000) -> Steadiness:
    """Time ``chunks`` runs of the same loop (``iterations`` integer additions, about 25 ms each on the development
    machine at its fastest) on this thread. A virtual machine whose host takes its cores away shows it here even
    when its own load average is low: on 2026-12-06 the development machine, idle (load 0.1, steal 0.1%), ran the
    same chunk in 25 to 52 ms within a minute, and the bare training step's two blocks of one round differed by up to
    60%."""
    import statistics

    times = []
    for _ in range(chunks):
        started, total = time.perf_counter(), 0
        for i in range(iterations):
            total += i
        times.append((time.perf_counter() - started) * 1e3)
    times.sort()
    return Steadiness(times[0], statistics.median(times), times[min(len(times) - 1, (len(times) * 9) // 10)])


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values`` (NaNs when empty)."""
    import statistics

    if not values:
        return (float("nan"),) * 3
    return statistics.median(values), min(values), max(values)


class ResultFile:
    """An append-only JSON-lines file of finished runs, so that a sweep can stop and continue: each run's record is
    written (and flushed to disk) as it ends, and a restarted sweep skips the keys already there.

    A line that does not parse (the half-written last line of a killed sweep) is ignored, and that run is done again.

    Args:
        path: the file (created with its directory on the first :meth:`add`).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def records(self) -> dict[str, dict[str, Any]]:
        """Every complete record by its ``key`` (a later record of the same key wins)."""
        out: dict[str, dict[str, Any]] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str):
                out[record["key"]] = record
        return out

    def add(self, key: str, record: dict[str, Any]) -> None:
        """Append ``record`` under ``key`` and fsync. A previous half-written line is ended first, so it stays one bad
        line and never swallows this record."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prefix = ""
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                prefix = "" if f.read(1) == b"\n" else "\n"
        with self.path.open("a") as f:
            f.write(prefix + json.dumps({"key": key, **record}, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
