"""Checkpoints of the trainer with torch.distributed.checkpoint (DCP), and the final safetensors export.

Layout under ``config.checkpoint_dir``::

    step-00000010/          one checkpoint: DCP files (model + optimizer, saved once, resharded on load),
      .metadata, *.distcp
      rng/rank-0.pt ...     each rank's RNG state
      rljob_commit.json     written last, atomically: the checkpoint exists only once this file does
    export/                 final weights in Hugging Face layout (config.json, model*.safetensors; rljob_trainer.export)

The commit file holds the step, documents_seen and the delivery bookkeeping: the stream entry ids that
each consumer (DP rank) consumed since the previous checkpoint, i.e. the entries whose effect this
checkpoint is the first to contain (DESIGN §6). Those ids are XACKed only after the commit file is
durable; after a crash between the commit and the ack, :func:`acknowledge_covered` acks the ones still
pending before any rank re-reads its pending entries, so an entry is never trained into two checkpoints.

Resharding: the model and optimizer state dicts go through ``torch.distributed.checkpoint.state_dict``,
so a checkpoint written by N ranks loads on M ranks, DDP-replicated or FSDP-sharded.

Lost checkpoints: rank 0 also records each commit in the Redis hash ``keys.checkpoint``, which outlives the pods.
At a start, :func:`find_lost_checkpoint` compares that record with what the volume holds: a recorded checkpoint
that is gone (an emptyDir volume after a gang restart or suspend) means the run restarts from an older step.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import JobConfig
from rljob_trainer import durable
from rljob_trainer.export import DEFAULT_MAX_SHARD_BYTES, export_hugging_face
from rljob_trainer.parallel import Distributed

log = logging.getLogger(__name__)

COMMIT_FILE = "rljob_commit.json"
"""Written by global rank 0 after every rank's part is on disk; its presence is the commit."""
EXPORT_DIR = c.EXPORT_SUBDIR
"""Sub-directory of the checkpoint dir holding the final Hugging Face export (the operator names it too)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class CommittedCheckpoint:
    """What a committed checkpoint's commit file says.

    ``covered_entry_ids``: consumer name → stream entry ids (``"<ms>-<seq>"``) that consumer consumed
    (trained, or dropped as over-long) since the previous checkpoint; ``world_size``: ranks that wrote it.
    """

    path: str
    step: int
    documents_seen: int
    world_size: int
    covered_entry_ids: dict[str, list[str]] = field(default_factory=dict)
    committed_at: float = 0.0

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


class CheckpointManager:
    """Saves, loads and prunes the checkpoints of one job; every rank holds one and calls it collectively.

    ``save`` and ``load`` are collective over the default process group; global rank 0 writes the commit
    file, the Redis hash ``keys.checkpoint`` and prunes to ``spec.trainer.checkpoint.keepLast``.
    """

    def __init__(self, config: JobConfig, where: Distributed, client: Optional[redis.Redis] = None) -> None:
        self.config = config
        self.where = where
        self.client = client
        self.root = Path(config.checkpoint_dir)
        self.keep_last = config.spec.trainer.checkpoint.keep_last

    # --- finding ----------------------------------------------------------------------------------
    def resume_source(self) -> tuple[Optional[Path], bool]:
        """(checkpoint to start from, whether it is this job's own).

        The latest committed checkpoint under ``config.checkpoint_dir`` (a resume: its covered entries belong
        to this job's stream), else ``initFrom`` (its bookkeeping is ignored), else ``(None, False)``.

        Raises:
            FileNotFoundError: ``initFrom`` is set but names no committed checkpoint.
        """
        own = committed_checkpoints(self.root)
        if own:
            return own[-1], True
        init_from = self.config.spec.trainer.checkpoint.init_from
        if init_from:
            return resolve_init_from(init_from), False
        return None, False

    # --- loading ----------------------------------------------------------------------------------
    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> CommittedCheckpoint:
        """Load model and optimizer state (resharded to this world size) and this rank's RNG state.

        ``model`` is the unwrapped module (not DDP). A rank without a saved RNG state (the world grew)
        seeds from ``(seed, rank, step)``.

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
    ) -> CommittedCheckpoint:
        """Write and commit the checkpoint of ``step`` (collective); return it once it is durable.

        Args:
            step: optimizer steps done.
            documents_seen: documents that entered the loss so far, all ranks.
            model: the unwrapped module.
            consumed_entry_ids: this rank's stream entry ids consumed since the previous checkpoint.

        On return the commit file is on disk on every rank's view, so the caller may XACK
        ``consumed_entry_ids``. Older checkpoints beyond ``keepLast`` are then deleted by rank 0.
        """
        target = step_dir(self.root, step)
        if self.where.is_rank_zero:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)  # an uncommitted leftover of a crashed attempt
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(target))
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.where.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.where.device)
        (target / "rng").mkdir(parents=True, exist_ok=True)
        durable.torch_save(rng, target / "rng" / f"rank-{self.where.rank}.pt")
        consumer = self.config.keys.consumer(self.where.rank)
        gathered: list[Any] = [None] * self.where.world_size
        dist.all_gather_object(gathered, (consumer, list(consumed_entry_ids)))
        committed = CommittedCheckpoint(
            path=str(target),
            step=step,
            documents_seen=documents_seen,
            world_size=self.where.world_size,
            covered_entry_ids={name: ids for name, ids in gathered},
            committed_at=time.time(),
        )
        if self.where.is_rank_zero:
            durable.write_text(target / COMMIT_FILE, json.dumps({k: v for k, v in asdict(committed).items() if k != "path"}))
            self._record_in_redis(committed)
        dist.barrier()
        if self.where.is_rank_zero:
            self._prune()
        log.info("checkpoint: committed %s (%d entries covered)", target, committed.num_covered)
        return committed

    def _record_in_redis(self, committed: CommittedCheckpoint) -> None:
        if self.client is None:
            return
        mapping = {
            "step": committed.step,
            "documents_seen": committed.documents_seen,
            "path": committed.path,
            "updated_at": repr(committed.committed_at),
        }
        try:
            self.client.hset(self.config.keys.checkpoint, mapping=mapping)
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
        shards by global rank 0 (:func:`rljob_trainer.export.export_hugging_face`); collective. Returns the directory
        on rank 0, None elsewhere."""
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
    if "step" not in record or "path" not in record:
        return None
    try:
        step = int(record["step"])
    except ValueError as err:
        raise ValueError(f"Redis hash {config.keys.checkpoint}: step {record['step']!r} is not an integer") from err
    if step <= restored_from_step or (Path(record["path"]) / COMMIT_FILE).is_file():
        return None
    return protocol.LostCheckpoint(step=step, path=record["path"], restored_from_step=restored_from_step)


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
        client.xack(keys.stream, keys.group, *still_pending)
        log.info("checkpoint: acked %d entries covered by %s that were still pending", len(still_pending), committed.path)
    return len(still_pending)


def _group_exists(client: redis.Redis, stream: str, group: str) -> bool:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return False
    return any(protocol.text(g["name"]) == group for g in groups)
