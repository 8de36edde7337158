"""The trainer entrypoint: ``torchrun … -m rljob_trainer.train`` (DESIGN §2), or :func:`run` in process.

One optimizer step on every data-parallel rank (DESIGN §4, §6):

1. read ``documentsPerStep / DP`` documents from the stream (this rank's consumer) and pack them into
   micro-batches of at most ``microBatchTokens`` tokens;
2. all-reduce the step's counts (labelled tokens, documents, tokens) so the loss divides by the GLOBAL
   normaliser (labelled tokens for GRPO, documents for GSPO);
3. per micro-batch: log-probabilities at the sampling temperature, the loss × DP (undoing DDP's gradient
   mean; ``no_sync`` on all but the last micro-batch), backward, metrics;
4. gradient clipping, AdamW with linear warm-up, metrics all-reduced (sum/max/min);
5. ``documents_seen`` += the step's documents; the new model_version is ``documents_seen``; rank 0 publishes
   the weights (``weights_ready``) and the progress hash;
6. every ``everySteps`` and at ``maxSteps``: a checkpoint; once it is durable rank 0 publishes its
   documents_seen (``checkpoint_documents_seen``, for the rollout's max lag), then each rank XACKs the entries it
   covers and rank 0 trims acked entries.

At every start (resumes included) the latest checkpoint (or ``initFrom``) is loaded; rank 0 warns when the
checkpoint Redis records is gone from the volume (``checkpoint_lost``), writes the start's step and documents_seen
to the progress hash (:func:`publish_start`), spreads the stream's pending entries over the current ranks before any
rank reads (:func:`start_reading`; the world size may have changed) and publishes the full weights with the
checkpoint's documents_seen.
At ``maxSteps``: final checkpoint, safetensors export, ``training_finished``, exit 0. Logs go to stderr, one JSON
line per step to stdout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import redis
import torch
import torch.distributed as dist

from rljob_api import constants as c, rules
from rljob_api.config import JobConfig
from rljob_trainer import loss as losses
from rljob_trainer.checkpoint import (
    CheckpointManager,
    CommittedCheckpoint,
    LostCheckpoint,
    acknowledge_covered,
    find_lost_checkpoint,
)
from rljob_trainer.loss_metrics import StepMetrics, token_entropy
from rljob_trainer.model import build_model, build_tokenizer, sequence_logprobs
from rljob_trainer.parallel import Distributed, init_distributed, shutdown_distributed, wrap_model
from rljob_trainer.progress import Progress, StepRecord, build_progress
from rljob_trainer.rollout.writer import reward_field_versions
from rljob_trainer.stream.batch import MicroBatch, flat_from_padded, pack_documents
from rljob_trainer.stream.connection import connect, retry_with_backoff
from rljob_trainer.stream.reader import StreamReader, redistribute_pending
from rljob_trainer.weights import WeightPublisher

log = logging.getLogger("rljob_trainer.train")


@dataclass(frozen=True)
class RunResult:
    """How a run ended: optimizer steps done, documents that entered the loss, the export directory (rank 0)."""

    step: int
    documents_seen: int
    export_dir: Optional[Path]


def learning_rate(step: int, base: float, warmup_steps: int) -> float:
    """Linear warm-up: ``base * (step + 1) / warmup_steps`` for the first ``warmup_steps`` updates, then ``base``.

    ``step`` is the number of updates already done (0 for the first one).
    """
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    return base


class _LogitsTap:
    """Calls the model like :func:`sequence_logprobs` does and keeps the logits (for the entropy metric)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.logits: Optional[torch.Tensor] = None

    def __call__(self, **kwargs: Any) -> Any:
        output = self.model(**kwargs)
        self.logits = output.logits
        return output


class Trainer:
    """One rank's training loop; built and driven by :func:`run`.

    Args:
        config: the resolved job config (every rank reads the same one).
        where: this rank's place in the process group (:func:`rljob_trainer.parallel.init_distributed`).
        client: the Redis client of this rank.
        stdout: where rank 0 writes the per-step JSON lines.
    """

    def __init__(self, config: JobConfig, where: Distributed, client: redis.Redis, stdout: TextIO = sys.stdout):
        spec = config.spec
        self.config = config
        self.where = where
        self.client = client
        self.temperature = spec.rollout.sampling.temperature
        self.epsilon_low, self.epsilon_high = spec.algorithm.resolved_epsilons()
        self.documents_per_rank = rules.documents_per_rank(spec.trainer.batch.documents_per_step,
                                                           config.data_parallel_size)
        if self.documents_per_rank is None:
            raise ValueError(
                f"spec.trainer.batch.documentsPerStep = {spec.trainer.batch.documents_per_step} is not divisible "
                f"by the data-parallel size {config.data_parallel_size}"
            )
        torch.manual_seed(spec.trainer.seed + where.rank)
        self.tokenizer = build_tokenizer(spec.model, spec.rollout.task)
        vocab_size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else self.tokenizer.vocab_size
        # float32 master weights (a Hub model loads in bf16); bf16 only inside autocast on GPU.
        self.model = build_model(spec.model, vocab_size, spec.trainer.seed).to(where.device, torch.float32)
        opt = spec.trainer.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.learning_rate, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay
        )
        self.checkpoints = CheckpointManager(config, where, client)
        self.step = 0
        self.documents_seen = 0
        self.metrics = StepMetrics.from_config(config, device=where.device)
        self.publisher: Optional[WeightPublisher] = None
        self.reader = StreamReader(
            client,
            config.keys,
            where.rank,
            config.data_parallel_size,
            micro_batch_tokens=spec.trainer.batch.micro_batch_tokens,
            require_metrics_fields=self.metrics.enabled,
            data_timeout_seconds=spec.trainer.data_timeout_seconds,
            vocab_size=self.model.get_input_embeddings().num_embeddings,
        )
        self.ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None
        self.progress: Progress = build_progress(config, client, where.rank, stdout=stdout)

    # --- start and end ----------------------------------------------------------------------------
    def resume(self) -> Optional[CommittedCheckpoint]:
        """Load the latest own checkpoint (or ``initFrom``), ack what it covers, publish where this attempt starts
        (warning about a lost checkpoint), spread the pending entries over the ranks and start the reader
        (:func:`start_reading`). Collective."""
        source, own = self.checkpoints.resume_source()
        committed = None
        if source is not None:
            committed = self.checkpoints.load(source, self.model, self.optimizer)
            self.step, self.documents_seen = committed.step, committed.documents_seen
            if own and self.where.is_rank_zero:
                acknowledge_covered(self.client, self.config, committed)
        if self.where.is_rank_zero:
            lost = find_lost_checkpoint(self.client, self.config, self.step)
            if lost is not None:
                log.warning("checkpoint: %s", lost.message)
            publish_start(self.client, self.config, self.step, self.documents_seen, lost, attempt=gang_attempt())
        start_reading(self.reader, self.where)  # after the acks and publish_start above: it begins with a barrier
        self.ddp = wrap_model(self.model, self.where)
        if self.where.is_rank_zero:
            self.publisher = WeightPublisher(self.config, self.client)
        self._publish()
        return committed

    def fit(self) -> RunResult:
        """Train until ``maxSteps``, then checkpoint, export and announce ``training_finished``. Collective."""
        max_steps = self.config.spec.trainer.max_steps
        every = self.config.spec.trainer.checkpoint.every_steps
        while self.step < max_steps:
            self.train_step()
            if self.step % every == 0 or self.step == max_steps:
                self.save_checkpoint()
        export_dir = None
        if self.config.spec.trainer.export.safetensors:
            export_dir = self.checkpoints.export(self.model, self.tokenizer)
        if self.publisher is not None:
            self.publisher.finish(step=self.step, documents_seen=self.documents_seen)
        log.info("training finished at step %d (%d documents seen)", self.step, self.documents_seen)
        return RunResult(self.step, self.documents_seen, export_dir)

    def close(self) -> None:
        """Release the Prometheus endpoint and the weight publisher (idempotent)."""
        self.progress.close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def save_checkpoint(self) -> CommittedCheckpoint:
        """Checkpoint (collective), publish its documents_seen (rank 0, :func:`publish_checkpointed`), then XACK the
        entries it covers and trim acked entries (rank 0)."""
        covered = self.reader.pending_ids()
        committed = self.checkpoints.save(self.step, self.documents_seen, self.model, self.optimizer, covered)
        if self.where.is_rank_zero:
            publish_checkpointed(self.client, self.config, self.documents_seen)
        dist.barrier()  # the rollout stops counting the covered entries as trained before they leave the pending list
        self.reader.ack(covered)
        dist.barrier()  # every rank's acks are in, so the trim reaches this checkpoint's entries
        if self.where.is_rank_zero:
            self.reader.trim_acked()
        return committed

    def _publish(self) -> None:
        if self.publisher is not None:
            named = ((name, tensor.detach()) for name, tensor in self.model.state_dict().items())
            self.publisher.publish(named, step=self.step, documents_seen=self.documents_seen)

    # --- one step ---------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        """Read, train and report one optimizer step (collective); see the module docstring."""
        assert self.ddp is not None, "call resume() first"
        # Exactly documents_per_rank (>= 1) valid documents: every rank has at least one micro-batch, so every
        # rank joins DDP's gradient all-reduce in its last backward.
        entries = self.reader.next_documents(self.documents_per_rank)
        started = time.monotonic()
        micro_batches = [
            mb.to(self.where.device)
            for mb in pack_documents([doc for _, doc in entries], self.config.spec.trainer.batch.micro_batch_tokens)
        ]
        counts = torch.zeros(4, dtype=torch.int64, device=self.where.device)
        for mb in micro_batches:
            labels, documents = losses.count_labels_and_documents(mb.label_mask, mb.document_index)
            counts += torch.stack([labels, documents, counts.new_tensor(mb.num_documents), counts.new_tensor(mb.num_tokens)])
        dist.all_reduce(counts)
        global_labels, global_documents, step_documents, step_tokens = counts.tolist()

        self.ddp.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.where.device)
        for index, mb in enumerate(micro_batches):
            sync = index == len(micro_batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                loss = self._micro_batch_loss(mb, global_labels, global_documents)
                losses.scale_for_ddp_mean(loss, self.where.world_size).backward()
            loss_sum += loss.detach().double()

        # Before the optimizer step: a mixed-presence error raised here (on every rank) leaves the weights untouched.
        reduced = self.metrics.reduce()
        opt = self.config.spec.trainer.optimizer
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), opt.grad_clip if opt.grad_clip > 0 else torch.inf)
        lr = learning_rate(self.step, opt.learning_rate, opt.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        stream_names = ("redeliveries", "dropped_too_long", "dead_lettered", "lost_pending")
        totals = torch.tensor(
            [loss_sum.item(), *(self._stream_counter(name) for name in stream_names)],
            dtype=torch.float64, device=self.where.device,
        )
        dist.all_reduce(totals)
        elapsed = max(time.monotonic() - started, 1e-9)

        self.step += 1
        self.documents_seen += step_documents
        self._publish()
        record = StepRecord(
            step=self.step,
            documents_seen=self.documents_seen,
            model_version=self.documents_seen,
            tokens_per_second=step_tokens / elapsed,
            metrics={"loss": totals[0].item(), "grad_norm": float(grad_norm), "learning_rate": lr, **reduced},
            stream={name: int(value) for name, value in zip(stream_names, totals[1:].tolist(), strict=True)},
        )
        self.progress.report(record)
        return record

    def _micro_batch_loss(self, mb: MicroBatch, global_labels: int, global_documents: int) -> torch.Tensor:
        """This micro-batch's share of the step loss (global normaliser) and its metrics update."""
        full = self.metrics.enabled and self.metrics.level == "full"
        model: Callable[..., Any] = _LogitsTap(self.ddp) if full else self.ddp
        with self._autocast():
            padded = sequence_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature)  # [B, L] float32
        new_logprobs = flat_from_padded(padded, mb.attention_mask)  # [T]
        common = dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high)
        if self.config.spec.algorithm.loss == "grpo":
            loss = losses.grpo_loss(
                new_logprobs, mb.old_logprobs, mb.advantages, mb.label_mask, mb.document_index,
                num_labels_in_batch=max(global_labels, 1), **common,
            )
        else:
            loss = losses.gspo_loss(
                new_logprobs, mb.old_logprobs, mb.advantages, mb.label_mask, mb.document_index,
                num_documents_in_batch=max(global_documents, 1), **common,
            )
        if self.metrics.enabled:
            entropy = None
            if full:
                per_row = token_entropy(model.logits[:, :-1], temperature=self.temperature)  # [B*(L-1)]
                per_row = per_row.reshape(mb.input_ids.shape[0], -1)
                entropy = flat_from_padded(torch.nn.functional.pad(per_row, (1, 0)), mb.attention_mask)
            self.metrics.update(
                new_logprobs=new_logprobs,
                old_logprobs=mb.old_logprobs,
                advantages=mb.advantages,
                label_mask=mb.label_mask,
                document_index=mb.document_index,
                documents_seen=self.documents_seen,
                reward=None if mb.rewards is None else mb.rewards[mb.document_index],
                model_version=mb.model_version,
                entropy=entropy,
            )
        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.where.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _stream_counter(self, name: str) -> float:
        value = getattr(self.reader.counters, name)
        return float(sum(value.values()) if isinstance(value, dict) else value)


def start_reading(reader: StreamReader, where: Distributed) -> None:
    """Collective start of every rank's reader: global rank 0 spreads the group's pending entries evenly over the
    current data-parallel ranks (:func:`~rljob_trainer.stream.reader.redistribute_pending`), all ranks wait at a
    barrier, then each re-reads its own pending entries (:meth:`StreamReader.start`).

    After a world-size change (DP 1 → 2, 3 → 2, ...) the old attempt's pending entries all belong to the old ranks'
    consumers; without the redistribution the new ranks would need fresh documents, which a rollout held at
    ``maxPending`` or max lag by those very entries never writes (the attempt would stall until
    ``dataTimeoutSeconds``), and the ranks' redeliveries would not match their per-step share. The barrier keeps
    every rank from reading before each entry has its one owner, so none is trained twice. Rank 0 adds the entries
    that were deleted from the stream to its ``lost_pending`` counter.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries on rank 0 (the barrier then fails on the other
            ranks; the next attempt redistributes again).
    """
    if where.is_rank_zero:
        result = redistribute_pending(reader.client, reader.keys, reader.dp_size)
        reader.counters.lost_pending += result.lost
    dist.barrier()
    reader.start()


def publish_start(
    client: redis.Redis,
    config: JobConfig,
    step: int,
    documents_seen: int,
    lost: Optional[LostCheckpoint],
    attempt: Optional[int] = None,
) -> None:
    """Rank 0 at every start: where this attempt starts, in the progress hash, and the rollout hash's rewards of an
    abandoned timeline dropped, in one MULTI/EXEC.

    Sets ``step``, ``documents_seen``, ``model_version`` (= documents_seen), ``restored_from_step`` (= step) and
    ``checkpoint_documents_seen`` (= documents_seen: nothing trained yet is unacked) to the loaded checkpoint's values
    (0 from scratch), and sets ``checkpoint_lost`` (JSON {step, path, restored_from_step, message, attempt}) or deletes
    it. ``attempt``: the gang attempt (env ``RLJOB_ATTEMPT``, :func:`gang_attempt`), so the operator never shows the
    record of an earlier attempt as this one's.
    The rollout's max lag needs this before the first step (:mod:`rljob_trainer.rollout.writer`): an earlier attempt's
    documents_seen would otherwise count this attempt's redelivered documents as trained.

    In the rollout hash it deletes the ``reward_sum:{v}`` / ``reward_count:{v}`` fields with v > ``documents_seen``:
    versions of a timeline this start abandoned (it started over, or from an older checkpoint), which the operator
    would otherwise keep showing as the newest reward (status.rolloutReward). Versions <= ``documents_seen`` and the
    hash's other fields stay. The field names are read with HKEYS under WATCH, so a field a rollout worker adds
    meanwhile reruns the transaction (redis-py :meth:`redis.Redis.transaction`). Not covered: a rollout worker still
    holding the abandoned weights tags its batches with the old version until it loads this start's weights (published
    right after), so such a field can come back for that short while; the operator ignores reward versions above
    the progress hash's model_version.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries (the attempt fails and is restarted).
    """
    key, rollout = config.keys.progress, config.keys.rollout

    def write(pipe: redis.client.Pipeline) -> None:
        versions = reward_field_versions(pipe.hkeys(rollout))
        abandoned = [name for name, version in versions.items() if version > documents_seen]
        pipe.multi()
        pipe.hset(key, mapping={
            c.PROGRESS_STEP: step,
            c.PROGRESS_DOCUMENTS_SEEN: documents_seen,
            c.PROGRESS_MODEL_VERSION: documents_seen,
            c.PROGRESS_RESTORED_FROM_STEP: step,
            c.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN: documents_seen,
        })
        if lost is None:
            pipe.hdel(key, c.PROGRESS_CHECKPOINT_LOST)
        else:
            record = {**asdict(lost), "message": lost.message, **({"attempt": attempt} if attempt is not None else {})}
            pipe.hset(key, c.PROGRESS_CHECKPOINT_LOST, json.dumps(record))
        if abandoned:
            pipe.hdel(rollout, *abandoned)

    client.transaction(write, rollout)


def gang_attempt() -> Optional[int]:
    """The gang attempt the operator stamped on this pod (env ``RLJOB_ATTEMPT``, status.attempt), or None outside the
    operator (tests, a manual torchrun) or when the value is not an integer."""
    try:
        return int(os.environ[c.ENV_ATTEMPT])
    except (KeyError, ValueError):
        return None


def publish_checkpointed(client: redis.Redis, config: JobConfig, documents_seen: int) -> None:
    """Rank 0 once a checkpoint is durable and before its entries are acked: ``checkpoint_documents_seen`` =
    ``documents_seen`` in the progress hash (the documents it covers leave the rollout's trained-unacked count).

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries (the acks that follow would fail as well).
    """
    client.hset(config.keys.progress, c.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN, documents_seen)


def run(config: JobConfig, *, client: Optional[redis.Redis] = None, stdout: TextIO = sys.stdout) -> RunResult:
    """Train one job on this process's rank until ``maxSteps``; the in-process form of the entrypoint.

    Under torchrun it joins the gang from the env; without it (tests) it forms a world of one. The process
    group is destroyed on return, also on failure.

    Raises:
        rljob_trainer.parallel.WorldSizeMismatch: WORLD_SIZE / (TP × PP) ≠ the config's DP size.
        rljob_trainer.stream.connection.RedisUnavailable: Redis unreachable for ``rendezvousTimeoutSeconds`` at start.
        rljob_trainer.stream.reader.DataTimeout: no document arrived for ``dataTimeoutSeconds``.
        FileNotFoundError: ``initFrom`` names no committed checkpoint.
    """
    where = init_distributed(config)
    trainer = None
    try:
        client = client or connect(config)
        # Redis may still be starting (managed Redis comes up with the gang): wait for it as for the gang,
        # rather than exiting and costing a gang restart.
        retry_with_backoff(client.ping, "connect to Redis", config.spec.trainer.rendezvous_timeout_seconds)
        trainer = Trainer(config, where, client, stdout)
        trainer.resume()
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()


def main() -> int:
    """Console entry: load ``RLJOB_CONFIG``, train, exit 0 at ``maxSteps``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    record(lambda: run(JobConfig.load()))()
    return 0


if __name__ == "__main__":
    sys.exit(main())
