"""Helpers of the trainer tests: a small job config, test documents, and torchrun launches of the trainer."""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from portutil import free_port
from source_tree import pythonpath
from rljob_api.config import JobConfig, RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_trainer.checkpoint import COMMIT_FILE, committed_checkpoints
from rljob_wire.model import DigitTokenizer
from rljob_wire.codec import Document, encode_document
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
JOIN_TIMEOUT_S = 90
"""Seconds :func:`run_ranks` waits for its spawned gloo ranks."""
TINY = {"layers": 1, "hiddenSize": 16, "heads": 2, "intermediateSize": 32, "maxPositionEmbeddings": 32}


def make_config(
    redis_server: Any,
    checkpoint_dir: Path,
    *,
    processes: int = 2,
    documents_per_step: int = 4,
    max_steps: int = 3,
    every_steps: int = 2,
    keep_last: int = 10,
    metrics: str = "basic",
    loss: str = "grpo",
    metrics_port: int = 0,
    data_timeout_seconds: int = 120,
    init_from: Optional[str] = None,
    max_pending: Optional[int] = None,
    max_lag: Optional[int] = None,
    parallelism: Optional[dict[str, Any]] = None,
    micro_batch_tokens: int = 24,
    model: Optional[dict[str, Any]] = None,
    replicas: int = 1,
    algorithm: Optional[dict[str, Any]] = None,
    optimizer: Optional[dict[str, Any]] = None,
    tensorboard: Optional[Path] = None,
) -> JobConfig:
    """A resolved config for a one-node trainer of ``processes`` ranks with a tiny model (or spec.model ``model``) and a
    managed Redis (``max_pending`` / ``max_lag``: spec.redis.maxPending / spec.rollout.maxLag, ``parallelism``:
    spec.trainer.parallelism, the spec's defaults if None; ``replicas``: spec.rollout.replicas, 0 for a trainer-only job;
    ``algorithm`` / ``optimizer``: fields added to spec.algorithm / spec.trainer.optimizer; ``tensorboard``:
    spec.trainer.tensorboard.logDir)."""
    rollout: dict[str, Any] = {"sampling": {"temperature": 0.7}, "replicas": replicas}
    if max_lag is not None:
        rollout["maxLag"] = max_lag
    spec = RLTrainingJobSpec.model_validate(
        {
            "model": model or {"source": "tiny", "tiny": TINY},
            "algorithm": {"loss": loss, "metrics": metrics, **(algorithm or {})},
            "trainer": {
                "processesPerNode": processes,
                "batch": {"documentsPerStep": documents_per_step, "microBatchTokens": micro_batch_tokens},
                **({"parallelism": parallelism} if parallelism is not None else {}),
                "optimizer": {"learningRate": 1e-2, "warmupSteps": 1, "gradClip": 1.0, "weightDecay": 0.01,
                              **(optimizer or {})},
                "checkpoint": {"everySteps": every_steps, "keepLast": keep_last, "initFrom": init_from},
                "maxSteps": max_steps,
                "collectiveTimeoutSeconds": 120,
                "dataTimeoutSeconds": data_timeout_seconds,
                **({"tensorboard": {"logDir": str(tensorboard)}} if tensorboard is not None else {}),
            },
            "rollout": rollout,
            **({"redis": {"maxPending": max_pending}} if max_pending is not None else {}),
        }
    )
    config = resolve("job", "ns", spec, RedisConnection(host=redis_server.host, port=redis_server.port))
    update = {
        "checkpoint_dir": str(checkpoint_dir),
        "metrics_port": metrics_port,
        "weights_port": free_port(),
        "trainer_master_host": "127.0.0.1",
    }
    return config.model_copy(update=update)


def read_events(client: Any, config: JobConfig) -> list[dict]:
    """The events stream as JSON objects, without the transfer ticket (an rljob extension with random ids)."""
    events = [json.loads(fields[b"event"]) for _, fields in client.xrange(config.keys.events)]
    for event in events:
        event.pop("transfer", None)
    return events


def digit_document(rng: np.random.Generator, model_version: int) -> Document:
    """A digit-task document: <bos>, 4 prompt digits, separator, 4 completion digits (prompt labels masked)."""
    tokenizer = DigitTokenizer()
    digits = "".join(str(d) for d in rng.integers(0, 10, 8))
    tokens = np.asarray(tokenizer.encode(digits[:4] + "|" + digits[4:]), dtype=np.int64)
    old = np.zeros(len(tokens), dtype=np.float32)
    old[6:] = rng.uniform(-3.0, -1.0, len(tokens) - 6).astype(np.float32)
    return Document(
        tokens=tokens,
        old_log_probabilities=old,
        model_version=np.full(len(tokens), model_version, dtype=np.int64),
        loss_masking_spans=[(0, 6)],
        advantage=float(rng.normal()),
        reward=float(rng.uniform()),
    )


def make_documents(count: int, seed: int, model_version: int = 0) -> list[Document]:
    """``count`` digit documents from a seeded generator (the same seed gives the same documents)."""
    rng = np.random.default_rng(seed)
    return [digit_document(rng, model_version) for _ in range(count)]


def write_documents(client: Any, config: JobConfig, docs: list[Document]) -> list[str]:
    """XADD ``docs`` to the job's stream in order; return their entry ids."""
    ids = []
    for doc in docs:
        entry = client.xadd(config.keys.stream, encode_document(doc))
        ids.append(entry.decode() if isinstance(entry, bytes) else entry)
    return ids


def write_config(config: JobConfig, path: Path) -> Path:
    path.write_text(config.to_json())
    return path


class Torchrun:
    """``python -m torch.distributed.run --nproc-per-node=N -m rljob_trainer.train`` in its own session.

    stdout and stderr go to files under ``log_dir``; :meth:`kill` SIGKILLs torchrun and every process below
    it (torchrun starts each worker in a session of its own, so a process-group kill would miss them).
    """

    def __init__(self, config_path: Path, nproc: int, port: int, password: str, log_dir: Path, tag: str):
        env = {
            k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(
            RLJOB_CONFIG=str(config_path),
            REDIS_PASSWORD=password,
            OMP_NUM_THREADS="1",
            PYTHONPATH=pythonpath(env),
        )
        self.stdout_path = log_dir / f"{tag}.stdout"
        self.stderr_path = log_dir / f"{tag}.stderr"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "rljob_trainer.train",
        ]
        self._out = open(self.stdout_path, "w")
        self._err = open(self.stderr_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._out, stderr=self._err, start_new_session=True)

    def wait(self, timeout: float) -> int:
        """Exit status; on timeout kill the group and fail with the logs."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"torchrun did not finish within {timeout} s\n{self.logs()}") from None

    def kill(self) -> None:
        """SIGKILL torchrun and its descendants at once (a node loss, not a graceful stop)."""
        for pid in [self.process.pid, *_descendants(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)
        self._out.close()
        self._err.close()

    def logs(self) -> str:
        self._out.flush()
        self._err.flush()
        return f"--- stdout\n{self.stdout_path.read_text()[-4000:]}\n--- stderr\n{self.stderr_path.read_text()[-8000:]}"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


class WeightReceiver:
    """A rollout member on a thread: heartbeats as transfer rank 1 and receives every weight update.

    ``received`` maps each update's documents_seen to its tensors (name → CPU tensor); stops at
    ``training_finished`` or :meth:`stop`.
    """

    def __init__(self, config: JobConfig, client: Any):
        from rljob_rollout.weight_subscriber import WeightSubscriber

        self.subscriber = WeightSubscriber(config, client, replica_index=0)
        self.subscriber.follow_from_now()
        self.subscriber.start_heartbeats(interval_s=0.5)
        self.received: dict[int, dict[str, Any]] = {}
        self.finished = False
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weight-receiver", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import torch

        from rljob_wire.transfer import receive_update

        try:
            while not self._stop.is_set() and not self.finished:
                for event in self.subscriber.poll(block_ms=200):
                    if event.type == "training_finished":
                        self.finished = True
                    elif event.ticket is not None:
                        tensors: dict[str, Any] = {}
                        rank = self.subscriber.transfer_ranks[0]
                        sink = functools.partial(_keep, tensors)
                        if receive_update(self.subscriber.address, event.ticket, rank, device=torch.device("cpu"), sink=sink):
                            self.received[event.documents_seen] = tensors
                            self.subscriber.version = event.documents_seen
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.subscriber.leave()


def _keep(into: dict[str, Any], name: str, tensor: Any) -> None:
    into[name] = tensor.clone()


def run_until_step_then_kill(
    config: JobConfig, config_path: Path, nproc: int, step: int, redis_server: Any, log_dir: Path, tag: str
) -> Torchrun:
    """Launch the trainer, wait until its progress hash reports ``step`` and the last checkpoint before it is
    committed and acked (:func:`wait_for_commit`; checkpoints are written in the background), then SIGKILL the
    whole gang.

    The caller writes exactly ``step`` steps of documents, so the ranks are blocked reading the next step
    when the kill lands (mid-run, after the checkpoints of the steps before).
    """
    client = redis_server.client()
    trainer = Torchrun(config_path, nproc, free_port(), redis_server.password, log_dir, tag)

    def reached() -> bool:
        if trainer.process.poll() is not None:
            raise AssertionError(f"trainer exited with {trainer.process.returncode} before step {step}\n{trainer.logs()}")
        return client.hget(config.keys.progress, "step") == str(step).encode()

    try:
        wait_until(reached, 240, f"progress step {step}", trainer.logs)
        checkpointed = step - step % config.spec.trainer.checkpoint.every_steps
        if checkpointed:
            wait_for_commit(client, config, checkpointed, trainer.logs)
    finally:
        trainer.kill()
    return trainer


def wait_for_commit(client: Any, config: JobConfig, step: int, logs=lambda: "", timeout: float = 60) -> None:
    """Wait until the checkpoint of ``step`` under ``config.checkpoint_dir`` is committed and none of the entries it
    covers is still pending (rank 0's commit thread acks them after the commit file)."""
    path = Path(config.checkpoint_dir) / f"step-{step:08d}" / COMMIT_FILE

    def settled() -> bool:
        if not path.is_file():
            return False
        covered = {e for ids in json.loads(path.read_text())["covered_entry_ids"].values() for e in ids}
        pending = client.xpending_range(config.keys.stream, config.keys.group, "-", "+", 100_000)
        return not covered & {row["message_id"].decode() for row in pending}

    wait_until(settled, timeout, f"checkpoint of step {step} committed and acked", logs)


def json_lines(trainer: Torchrun) -> list[dict]:
    """The per-step JSON objects a trainer printed on stdout."""
    return [json.loads(line) for line in trainer.stdout_path.read_text().splitlines() if line.startswith("{")]


class XackMonitor:
    """Counts every entry id of every XACK the Redis server executes (Redis MONITOR, in a thread)."""

    SENTINEL = "rljob-test-stop-monitor"

    def __init__(self, redis_server):
        self.redis_server = redis_server
        self.acks: collections.Counter[str] = collections.Counter()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "MONITOR did not start"

    def _listen(self) -> None:
        with self.redis_server.client(socket_timeout=None).monitor() as monitor:
            self._ready.set()
            for command in monitor.listen():
                words = command["command"].split()
                if words and words[0].upper() == "XACK":
                    self.acks.update(words[3:])  # XACK <stream> <group> <id>...
                elif self.SENTINEL in command["command"]:
                    return

    def stop(self) -> collections.Counter:
        self.redis_server.client().echo(self.SENTINEL)
        self._thread.join(10)
        assert not self._thread.is_alive(), "MONITOR thread did not stop"
        return self.acks


def covered_by_checkpoint(root):
    """{step: [entry ids the committed checkpoint covers]} of every committed checkpoint under ``root``."""
    out = {}
    for path in committed_checkpoints(root):
        commit = json.loads((path / COMMIT_FILE).read_text())
        out[commit["step"]] = [entry for ids in commit["covered_entry_ids"].values() for entry in ids]
    return out


def leave_rank() -> None:
    """End a spawned rank at once (``os._exit(0)``) after its last collective and its results are written: no
    destructor runs. Under load a DDP rank once hung in the teardown of its worker's frame (its model's reducer,
    after ``destroy_process_group``), the stack dump of :func:`_rank_main` showed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, worker, world_size: int, tmp_dir: str, *args) -> None:
    """One spawned rank: its stacks go to stderr shortly before :func:`run_ranks` gives up on it, and a rank that
    finished its work leaves at once (``os._exit``), as train.main does: torch 2.13's gloo teardown at interpreter
    exit has hung or aborted a finished rank under load."""
    import faulthandler

    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 10, exit=False)
    worker(rank, world_size, tmp_dir, *args)
    leave_rank()


def run_ranks(worker, world_size: int, tmp_path: Path, *args) -> None:
    """Run ``worker(rank, world_size, tmp_dir, *args)`` in spawned processes; fail on an error or a timeout."""
    context = mp.start_processes(
        _rank_main, args=(worker, world_size, str(tmp_path), *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} gloo ranks did not finish within {JOIN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def init_gloo(rank: int, world_size: int, tmp_dir: str) -> None:
    """Join a gloo process group of ``world_size`` through a file:// rendezvous in ``tmp_dir`` (30 s timeout)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_dir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
