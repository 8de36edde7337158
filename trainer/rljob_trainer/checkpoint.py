"""Checkpoints of the trainer with torch.distributed.checkpoint (DCP), saved asynchronously, and the final export.

Layout under ``config.checkpoint_dir``::

    step-00000010/          one checkpoint: DCP files (model + optimizer, saved once, resharded on load),
      .metadata, *.distcp
      rng/rank-0.pt ...     each rank's RNG state
      rljob_commit.json     written last, atomically: the checkpoint exists only once this file does
    export/                 final weights in Hugging Face layout (config.json, model*.safetensors; rljob_trainer.export)

The commit file holds the step, documents_seen and the delivery bookkeeping: the stream entry ids that each
consumer (DP rank) consumed since the previous checkpoint, i.e. the entries whose effect this checkpoint is the first
to contain (DESIGN §6). Those ids are XACKed only after the commit file is durable; after a crash between the commit
and the ack, :func:`acknowledge_covered` acks the ones still pending before any rank re-reads its pending entries, so
an entry is never trained into two checkpoints.

Asynchronous save (:meth:`CheckpointManager.save`): the training loop stops only for the snapshot. Every rank waits for
the previous save to finish, copies its model and optimizer state (its shards under fsdp) to host memory (DCP's
``DefaultStager``: one set of host buffers reused by every save, pinned on GPU), writes its RNG file, and the ranks
gather each consumer's covered entry ids; then ``dcp.async_save`` writes the files from that copy in a background thread
(fsync per file) and training continues (on CPU, a sharded state of at most :data:`WAITED_WRITE_MAX_BYTES` per rank is
written before training goes on: see that constant). The upload's collectives (planning, and the final gather of every
rank's write results before rank 0 writes ``.metadata``) run on a gloo process group of their own, so they never
interleave with the training loop's collectives. When rank 0's upload completes, every rank's files are durable; rank
0's commit thread then writes the commit file (fsync of the file and the directory), records the step in Redis and runs
``on_commit`` (the trainer: publish ``checkpoint_documents_seen``, XACK every rank's covered entries, trim), then
prunes. A failure anywhere (a rank's write, the commit, Redis) is raised by :meth:`CheckpointManager.poll` or
:meth:`CheckpointManager.wait` on the next call, never dropped: the rank exits non-zero, the gang restarts from the last
committed checkpoint, and the entries of the failed one, never acked, are delivered again. A crash before the commit
file is durable leaves an uncommitted directory (pruned later) and the same redelivery.

Resharding: the model and optimizer state dicts go through ``torch.distributed.checkpoint.state_dict``, so a
checkpoint written by N ranks loads on M ranks, under either strategy: DDP-replicated tensors are saved once, FSDP2
shards (DTensors) each by their owner, and DCP reads whatever slices the loading ranks' tensors cover.

Lost checkpoints: rank 0 also records each commit in the Redis hash ``keys.checkpoint``, which outlives the pods.
At a start, :func:`find_lost_checkpoint` compares that record with what the volume holds: a recorded checkpoint
that is gone (an emptyDir volume after a gang restart or suspend) means the run restarts from an older step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import JobConfig
from rljob_trainer import durable, fence
from rljob_trainer.export import DEFAULT_MAX_SHARD_BYTES, export_hugging_face
from rljob_trainer.parallel import Distributed
from rljob_trainer.stream.reader import ack_entries

log = logging.getLogger(__name__)

COMMIT_FILE = "rljob_commit.json"
"""Written by global rank 0 after every rank's part is on disk; its presence is the commit."""
EXPORT_DIR = c.EXPORT_SUBDIR
"""Sub-directory of the checkpoint dir holding the final Hugging Face export (the operator names it too)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")

WAITED_WRITE_MAX_BYTES = 64 << 20
"""On CPU, a checkpoint whose state is sharded (DTensors, fsdp) and holds at most this many bytes per rank (its global
size over the world size, alike on every rank) is written by ``dcp.save`` before the training loop goes on, not beside
it: on CPU the writer thread's work on a sharded state took the interpreter and the cores from the steps it ran beside.
Measured with ``benchmarks/trainer_step.py`` (c), the CPU example under fsdp at 1 rank (2 idle cores): the steps beside
the write ran 10-17 ms longer each (checkpoints every 5 steps); written before going on (no host copy, no thread), the
checkpoint cost 8.2 ms a step against a plain ``dcp.save``'s 7.0, and (c)/(c0) went from 81.5% and 83.1% (2 pairs,
beside) to 87.8%. Unsharded (ddp) writes stay beside the steps: the same pairs under ddp measured no gain from waiting
for the background write (87.8% and 90.7% beside, 84.4% and 80.3% waited); so do larger ones, whose write is mostly
bytes (a 148M-parameter model's waited write cost more than it saved, docs/trainer-step.md)."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    """What a committed checkpoint's commit file says.

    ``covered_entry_ids``: consumer name → stream entry ids (``"<ms>-<seq>"``) that consumer consumed
    (trained, or dropped as over-long) since the previous checkpoint; ``world_size``: ranks that wrote it;
    ``attempt``: the gang attempt that committed it (None: outside the operator, or written before fencing).
    """

    path: str
    step: int
    documents_seen: int
    world_size: int
    covered_entry_ids: dict[str, list[str]] = field(default_factory=dict)
    committed_at: float = 0.0
    attempt: Optional[int] = None

    @classmethod
    def read(cls, directory: Path) -> "CommittedCheckpoint":
        """Read ``directory/rljob_commit.json``.

        Raises:
            FileNotFoundError: not a committed checkpoint.
            ValueError: the commit file is not valid JSON or lacks a field.
        """
        raw = json.loads((directory / COMMIT_FILE).read_text())
        try:
            return cls(**{**raw, "path": str(directory)})
        except TypeError as err:
            raise ValueError(f"{directory / COMMIT_FILE}: {err}") from err

    @property
    def num_covered(self) -> int:
        return sum(len(ids) for ids in self.covered_entry_ids.values())


def step_dir(root: Path, step: int) -> Path:
    """``root/step-{step:08d}``."""
    return root / f"step-{step:08d}"


def committed_checkpoints(root: Path) -> list[Path]:
    """The committed checkpoint directories under ``root``, oldest step first (empty if ``root`` is missing)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMMIT_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_init_from(path: str) -> Path:
    """The committed checkpoint that ``spec.trainer.checkpoint.initFrom`` names.

    ``path`` is either a checkpoint directory (with a commit file) or a checkpoint root, of which the
    latest committed checkpoint is taken.

    Raises:
        FileNotFoundError: neither; the message names the field and the path.
    """
    directory = Path(path)
    if (directory / COMMIT_FILE).is_file():
        return directory
    found = committed_checkpoints(directory)
    if found:
        return found[-1]
    raise FileNotFoundError(
        f"spec.trainer.checkpoint.initFrom: {path!r} is neither a committed rljob checkpoint (no {COMMIT_FILE}) "
        f"nor a directory holding one (step-XXXXXXXX/{COMMIT_FILE})"
    )


class CheckpointSaveFailed(RuntimeError):
    """An asynchronous checkpoint save failed (a rank's write, the commit, or its Redis bookkeeping); the message
    names the step and the directory, the cause is chained. The checkpoint is not committed, or committed without
    its acks (the next start acks them, :func:`acknowledge_covered`)."""


@dataclass(frozen=True)
class CheckpointSave:
    """One checkpoint save as this rank saw it.

    Attributes:
        checkpoint: what the commit file says (``committed_at``: unix seconds of the commit on global rank 0 once
            finished, 0.0 before and on other ranks).
        blocking_ms: milliseconds the training loop stood still for it on this rank: waiting for the previous save,
            the barrier, the snapshot to host memory, the RNG file, the gather of covered ids, starting the upload.
        save_ms: milliseconds from the start of :meth:`CheckpointManager.save` to the end of the commit (every
            rank's files durable, commit file written, ``on_commit`` done); global rank 0 once finished, else None.
    """

    checkpoint: CommittedCheckpoint
    blocking_ms: float
    save_ms: Optional[float] = None


@dataclass
class _Pending:
    save: CheckpointSave
    upload: Future  # DCP's upload of this rank's files
    commit: Optional[Future]  # rank 0: upload of every rank -> commit file -> Redis -> on_commit -> prune


class CheckpointManager:
    """Saves, loads and prunes the checkpoints of one job; every rank holds one and calls it collectively.

    ``save``, ``load`` and ``export`` are collective over the default process group; ``poll``, ``wait`` and ``close``
    are local. Global rank 0 writes the commit file, the Redis hash ``keys.checkpoint``, runs ``on_commit`` and prunes to
    ``spec.trainer.checkpoint.keepLast``. At most one save is in flight: :meth:`save` first waits for the previous.

    Args:
        on_commit: called on global rank 0, in its commit thread, with each checkpoint once its commit file is
            durable (the trainer acks the covered entries there); an exception fails the save.
    """

    def __init__(
        self,
        config: JobConfig,
        where: Distributed,
        client: Optional[redis.Redis] = None,
        *,
        on_commit: Optional[Callable[[CommittedCheckpoint], None]] = None,
    ) -> None:
        self.config = config
        self.where = where
        self.client = client
        self.root = Path(config.checkpoint_dir)
        self.keep_last = config.spec.trainer.checkpoint.keep_last
        self.on_commit = on_commit
        self._pending: Optional[_Pending] = None
        self._done: list[CheckpointSave] = []
        self._group: Optional[dist.ProcessGroup] = None
        self._stager: Optional[DefaultStager] = None
        self._committer: Optional[ThreadPoolExecutor] = None

    # --- finding ----------------------------------------------------------------------------------
    def resume_source(self) -> tuple[Optional[Path], bool]:
        """(checkpoint to start from, whether it is this job's own), as global rank 0 finds it and tells every rank
        (a collective when there are several ranks: a checkpoint committed while the ranks look, by a leftover of an
        earlier attempt, must not make them load different ones).

        The latest committed checkpoint under ``config.checkpoint_dir`` (a resume: its covered entries belong
        to this job's stream), else ``initFrom`` (its bookkeeping is ignored), else ``(None, False)``.

        Raises:
            FileNotFoundError: ``initFrom`` is set but names no committed checkpoint (on every rank).
        """
        found: list[Any] = [None]
        if self.where.is_rank_zero:
            try:
                found[0] = self._find_source()
            except FileNotFoundError as err:
                found[0] = err
        if dist.is_available() and dist.is_initialized() and self.where.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        if isinstance(found[0], FileNotFoundError):
            raise FileNotFoundError(str(found[0]))
        path, own = found[0]
        return (None if path is None else Path(path)), own

    def _find_source(self) -> tuple[Optional[str], bool]:
        own = committed_checkpoints(self.root)
        if own:
            return str(own[-1]), True
        init_from = self.config.spec.trainer.checkpoint.init_from
        if init_from:
            return str(resolve_init_from(init_from)), False
        return None, False

    # --- loading ----------------------------------------------------------------------------------
    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> CommittedCheckpoint:
        """Load model and optimizer state (resharded to this world size and strategy) and this rank's RNG state.

        ``model`` is the transformers model (not the DDP wrapper; FSDP2-sharded or not), whichever strategy and world
        size wrote the checkpoint. A rank without a saved RNG state (the world grew) seeds from ``(seed, rank, step)``.

        Raises:
            FileNotFoundError / ValueError: ``directory`` is not a committed checkpoint.
            RuntimeError: the DCP files do not match the model (another architecture).
        """
        committed = CommittedCheckpoint.read(directory)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        rng_file = directory / "rng" / f"rank-{self.where.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.where.device)
        else:
            torch.manual_seed(self.config.spec.trainer.seed * 1_000_003 + self.where.rank * 7919 + committed.step)
        log.info(
            "checkpoint: loaded %s (step %d, documents_seen %d, written by %d ranks, loaded by %d)",
            directory, committed.step, committed.documents_seen, committed.world_size, self.where.world_size,
        )
        return committed

    # --- saving -----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        documents_seen: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        consumed_entry_ids: list[str],
    ) -> CheckpointSave:
        """Snapshot the checkpoint of ``step`` and start writing it (collective); return once the snapshot is taken.

        Args:
            step: optimizer steps done.
            documents_seen: documents that entered the loss so far, all ranks.
            model: the transformers model (not the DDP wrapper).
            optimizer: its optimizer.
            consumed_entry_ids: this rank's stream entry ids consumed since the previous checkpoint; global rank 0
                acks every rank's through ``on_commit`` once the checkpoint is committed.

        On return the model and optimizer may change: the files are written from a host copy. The commit follows in
        the background (module docstring); :meth:`poll` and :meth:`wait` return it once finished.

        Raises:
            CheckpointSaveFailed: the previous save failed (raised before anything of this one happens).
        """
        started = time.monotonic()
        self._finish()
        target = step_dir(self.root, step)
        if self.where.is_rank_zero:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)  # an uncommitted leftover of a crashed attempt
        dist.barrier()
        consumer = self.config.keys.consumer(self.where.rank)
        gathered: list[Any] = [None] * self.where.world_size
        dist.all_gather_object(gathered, (consumer, list(consumed_entry_ids)))
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.where.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.where.device)
        (target / "rng").mkdir(parents=True, exist_ok=True)
        durable.torch_save(rng, target / "rng" / f"rank-{self.where.rank}.pt")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        if self.where.device.type == "cpu" and waits_for_write(self.where.world_size, model_sd, optim_sd):
            upload = self._write_now(state, target)
        else:
            upload = dcp.async_save(state, checkpoint_id=str(target), process_group=self._checkpoint_group(),
                                    async_stager=self._host_stager())
        checkpoint = CommittedCheckpoint(
            path=str(target),
            step=step,
            documents_seen=documents_seen,
            world_size=self.where.world_size,
            covered_entry_ids={name: ids for name, ids in gathered},
        )
        save = CheckpointSave(checkpoint, blocking_ms=(time.monotonic() - started) * 1000)
        commit = None
        if self.where.is_rank_zero:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rljob-checkpoint-commit")
            commit = self._committer.submit(self._commit, upload, checkpoint, started)
        self._pending = _Pending(save, upload, commit)
        return save

    def poll(self) -> list[CheckpointSave]:
        """The saves that have finished on this rank since the last :meth:`poll` or :meth:`wait`, oldest first; never
        blocks. Called after every step, as the trainer does, that is at most two: the one :meth:`save` waited for,
        and the one it started.

        Raises:
            CheckpointSaveFailed: the save in flight failed (reported once).
        """
        pending = self._pending
        if pending is not None and pending.upload.done() and (pending.commit is None or pending.commit.done()):
            self._finish()
        done, self._done = self._done, []
        return done

    def wait(self) -> list[CheckpointSave]:
        """Block until the save in flight has finished on this rank (on global rank 0: committed and ``on_commit``
        done); return what :meth:`poll` would then return.

        Raises:
            CheckpointSaveFailed: the save in flight failed (reported once).
        """
        self._finish()
        done, self._done = self._done, []
        return done

    def _finish(self) -> None:
        """Wait for the save in flight, if any, and add it to the finished saves."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        save = pending.save
        try:
            pending.upload.result()
            if pending.commit is not None:
                committed_at, save_ms = pending.commit.result()
                save = dataclasses.replace(save, checkpoint=dataclasses.replace(save.checkpoint, committed_at=committed_at),
                                           save_ms=save_ms)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise CheckpointSaveFailed(f"checkpoint of step {save.checkpoint.step} ({save.checkpoint.path}) failed: "
                                       f"{type(err).__name__}: {err}") from err
        self._done.append(save)

    def close(self) -> None:
        """Finish the save in flight (a failure is logged, not raised: ``close`` runs while a run ends, also on an
        error), release the host staging buffers and the commit thread. Idempotent; the next save starts afresh."""
        try:
            self._finish()
        except CheckpointSaveFailed as err:
            log.error("checkpoint: %s", err)
        self._done = []
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None

    def _write_now(self, state: dict[str, Any], target: Path) -> Future:
        """``dcp.save`` of ``state`` from the live tensors (nothing changes them before it returns, so no host copy), as
        the finished future of an upload: its error is raised where a background write's is (poll, wait)."""
        upload: Future = Future()
        try:
            dcp.save(state, checkpoint_id=str(target), process_group=self._checkpoint_group())
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's is a BaseException
            upload.set_exception(error)
        else:
            upload.set_result(None)
        return upload

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """The gloo group of the uploads' collectives (made at the first save, on every rank: a collective)."""
        if self._group is None:
            timeout = timedelta(seconds=self.config.spec.trainer.collective_timeout_seconds)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def _host_stager(self) -> DefaultStager:
        """The host copy of this rank's state: one buffer per tensor, reused by every save; pinned on GPU."""
        if self._stager is None:
            on_gpu = self.where.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=on_gpu))
        return self._stager

    def _commit(self, upload: Future, checkpoint: CommittedCheckpoint, started: float) -> tuple[float, float]:
        """Rank 0's commit thread: once every rank's files are durable, write the commit file, record it in Redis, run
        ``on_commit``, prune. Returns (committed_at unix seconds, milliseconds since the save started)."""
        upload.result()  # rank 0's upload ends after every rank's writes (DCP gathers their results first)
        if self.client is not None:  # a leftover of an earlier attempt commits nothing (the check narrows the window
            fence.check(self.client, self.config.keys)  # to this thread's next few milliseconds; DESIGN §6)
        committed = dataclasses.replace(checkpoint, committed_at=time.time(), attempt=fence.gang_attempt())
        target = Path(committed.path)
        durable.write_text(target / COMMIT_FILE, json.dumps({k: v for k, v in asdict(committed).items() if k != "path"}))
        self._record_in_redis(committed)
        if self.on_commit is not None:
            self.on_commit(committed)
        self._prune()
        save_ms = (time.monotonic() - started) * 1000
        log.info("checkpoint: committed %s (%d entries covered) %.0f ms after its snapshot began", target,
                 committed.num_covered, save_ms)
        return committed.committed_at, save_ms

    def _record_in_redis(self, committed: CommittedCheckpoint) -> None:
        if self.client is None:
            return
        mapping = protocol.CheckpointRecord(step=committed.step, documents_seen=committed.documents_seen,
                                            path=committed.path, committed_at=committed.committed_at).to_fields()
        try:
            fence.write(self.client, self.config.keys,
                        [("HSET", self.config.keys.checkpoint, *fence.flat(mapping))])
        except redis.RedisError as err:
            log.warning("checkpoint: could not record step %d in %s: %s", committed.step, self.config.keys.checkpoint, err)

    def _prune(self) -> None:
        """Delete committed checkpoints beyond keepLast and uncommitted directories older than the newest."""
        committed = committed_checkpoints(self.root)
        for old in committed[: max(0, len(committed) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        if not committed:
            return
        newest = committed[-1].name
        for child in self.root.iterdir():
            if _STEP_DIR.match(child.name) and child.name < newest and not (child / COMMIT_FILE).exists():
                shutil.rmtree(child, ignore_errors=True)

    # --- export -----------------------------------------------------------------------------------
    def export(self, model: torch.nn.Module, tokenizer: Any = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Optional[Path]:
        """The final weights in Hugging Face layout under ``checkpoint_dir/export``, written tensor by tensor from the
        shards by global rank 0 (:func:`rljob_trainer.export.export_hugging_face`); collective. Waits for the save in
        flight first. Returns the directory on rank 0, None elsewhere.

        Raises:
            CheckpointSaveFailed: the save in flight failed.
        """
        self._finish()
        return export_hugging_face(model, self.root / EXPORT_DIR, writer=self.where.is_rank_zero, tokenizer=tokenizer,
                                   max_shard_bytes=max_shard_bytes)


def find_lost_checkpoint(client: redis.Redis, config: JobConfig,
                         restored_from_step: int) -> Optional[protocol.LostCheckpoint]:
    """The checkpoint recorded in the Redis hash ``keys.checkpoint`` if it is gone and newer than the start.

    Args:
        restored_from_step: the step of the checkpoint being loaded (own or ``initFrom``), 0 without one.

    Returns:
        A LostCheckpoint (no attempt stamped) when the hash records a step above ``restored_from_step`` whose directory holds no
        commit file, else None (no record, or nothing newer is missing: a record that a Redis error left behind an
        own checkpoint is not a loss).

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries.
        ValueError: the hash's ``step`` is not an integer.
    """
    record = {protocol.text(k): protocol.text(v) for k, v in client.hgetall(config.keys.checkpoint).items()}
    raw_step, path = record.get(protocol.CHECKPOINT_STEP), record.get(protocol.CHECKPOINT_PATH)
    if raw_step is None or path is None:
        return None
    try:
        step = int(raw_step)
    except ValueError as err:
        raise ValueError(f"Redis hash {config.keys.checkpoint}: step {raw_step!r} is not an integer") from err
    if step <= restored_from_step or (Path(path) / COMMIT_FILE).is_file():
        return None
    return protocol.LostCheckpoint(step=step, path=path, restored_from_step=restored_from_step)


def acknowledge_covered(client: redis.Redis, config: JobConfig, committed: CommittedCheckpoint) -> int:
    """XACK the entries ``committed`` covers that are still pending; return how many were acked.

    Run by global rank 0 at a resume, before any rank reads: it closes the window between a checkpoint's
    commit and its acks. Entries already acked are left alone, so each entry id is acked exactly once. A Redis
    without the job's consumer group (a new Redis, or the job re-created while its checkpoint volume was kept) has
    nothing pending: 0.
    """
    covered = {entry for ids in committed.covered_entry_ids.values() for entry in ids}
    keys = config.keys
    if not covered or not _group_exists(client, keys.stream, keys.group):
        return 0
    low = min(covered, key=protocol.entry_order)
    high = max(covered, key=protocol.entry_order)
    still_pending: list[str] = []
    start = low
    while True:
        page = client.xpending_range(keys.stream, keys.group, min=start, max=high, count=1000)
        if not page:
            break
        ids = [protocol.text(row["message_id"]) for row in page]
        still_pending.extend(entry for entry in ids if entry in covered)
        if len(page) < 1000:
            break
        start = "(" + ids[-1]
    if still_pending:
        ack_entries(client, keys, still_pending)
        log.info("checkpoint: acked %d entries covered by %s that were still pending", len(still_pending), committed.path)
    return len(still_pending)


def _group_exists(client: redis.Redis, stream: str, group: str) -> bool:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return False
    return any(protocol.text(g["name"]) == group for g in groups)


def waits_for_write(world_size: int, *states: Any) -> bool:
    """Whether a CPU save of ``states`` (state dicts, nested) is written before training goes on: sharded (a DTensor
    among them) and at most :data:`WAITED_WRITE_MAX_BYTES` of tensor data per rank of ``world_size``. Reckoned from
    global sizes, so every rank decides alike (each issues the save's collectives the same way)."""
    tensors = [leaf for leaf in tree_leaves(states) if isinstance(leaf, torch.Tensor)]
    if not any(isinstance(tensor, DTensor) for tensor in tensors):
        return False
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors) <= WAITED_WRITE_MAX_BYTES * world_size
