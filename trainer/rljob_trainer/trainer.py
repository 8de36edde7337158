"""One rank's training loop (:class:`Trainer`), built and driven by :func:`rljob_trainer.train.run`.

One optimizer step on every data-parallel rank (DESIGN §4, §6):

1. read ``documentsPerStep / DP`` documents from the stream (this rank's consumer; with ``algorithm.maxStaleness``,
   documents staler than it are dropped, counted, acked with the next checkpoint, and replaced by reading on) and pack
   them into micro-batches of at most ``microBatchTokens`` tokens; segment each micro-batch into documents once;
2. sum the step's counts (labelled tokens, documents, tokens) over the ranks, and take the most micro-batches any
   rank packed, in one collective (:func:`~rljob_trainer.parallel.start_reduce_small`), so the loss divides by the
   GLOBAL normaliser (labelled tokens for GRPO, documents for GSPO); it is started here and waited for where the
   first loss needs it (:class:`GlobalCounts`: after the first forward of an unsharded model; under fsdp before it,
   for the padding below). Once it has arrived every rank holds its documents, so the reader sends the next step's
   read (:meth:`~rljob_trainer.stream.reader.StreamReader.prefetch`), which arrives while this step computes;
3. per micro-batch: the frozen reference policy's log-probabilities when ``algorithm.klCoef`` > 0 (no gradient),
   the trained policy's at the sampling temperature, the loss with ``spec.algorithm``'s corrections × DP (undoing
   the gradient mean over data-parallel ranks; ddp all-reduces in the last backward only, fsdp reduce-scatters every
   backward, :meth:`DataParallelModel.micro_batch`), backward, and the metrics from what the loss returned; under
   fsdp a rank that packed fewer micro-batches than another (documents of other lengths) then runs padding
   backwards (log-probabilities × 0) until it has run as many, so every rank calls the same collectives;
4. every reduction after the loss (metrics, the loss value, the stream counters) in ``StepMetrics.start_reduce``: one
   sum every step and a maximum when metrics are on, one collective for both up to 16 ranks, travelling while the
   gradients are clipped and waited for before the optimizer step; then AdamW with the learning rate of
   :func:`~rljob_trainer.optim.step_learning_rate` (warm-up, then constant, linear or cosine decay);
5. ``documents_seen`` += the step's documents (those that entered the loss); the new model_version is
   ``documents_seen``; every rank takes part in the weight publication (:func:`~rljob_trainer.weight_publisher.publish_weights`:
   rank 0 announces ``weights_ready`` and sends, under fsdp the others join the gathers of sharded parameters, one
   tensor at a time), whose duration is the step's ``weight_sync_time_ms``. An unsharded model on CPU
   (:attr:`Trainer.overlaps_publication`) publishes beside the next step instead: rank 0's publisher thread sends
   while the next step reads, packs and runs forward and backward, and that step waits for it (``settle``) only
   before its optimizer step changes the weights; the step's record is reported once its publication ended, with
   its wall time as ``weight_sync_overlapped_time_ms``;
6. every ``everySteps`` and at ``maxSteps``: a checkpoint (:meth:`Trainer.save_checkpoint`). The loop stops only for
   its snapshot to host memory; the files are written in the background, and once they are durable rank 0's commit
   thread writes the commit file, publishes its documents_seen (``checkpoint_documents_seen``, for the rollout's max
   lag) and the stale drops it covers (``checkpoint_dropped_stale``), XACKs the entries it covers (every rank's) and
   trims acked entries. The final checkpoint is waited for;
7. rank 0 reports the step (progress hash, JSON line, gauges), with the timings of
   :data:`~rljob_trainer.metrics_registry.TIMINGS`: ``weight_sync_time_ms`` and the step's phases
   (:data:`~rljob_trainer.metrics_registry.STEP_PHASES`, which partition ``step_time_ms``: read, decode, pack,
   forward/backward, metrics, collectives, optimizer, ...; :class:`PhaseClock`) every step, the checkpoint timings
   when the step saved or a save finished.

At every start (resumes included) the latest checkpoint (or ``initFrom``) is loaded; rank 0 warns when the
checkpoint Redis records is gone from the volume (``checkpoint_lost``), writes the start's step and documents_seen
to the progress hash (:func:`rljob_trainer.progress_report.publish_start`), spreads the stream's pending entries over the
current ranks before any rank reads (:func:`start_reading`; the world size may have changed) and publishes the full
weights with the checkpoint's documents_seen. At ``maxSteps``: final checkpoint (durable and
committed before anything else), safetensors export, ``training_finished``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, TextIO

import redis
import torch
import torch.distributed as dist

from rljob_api import protocol, rules
from rljob_api.config import JobConfig
from rljob_api.validation import topology_numbers
from rljob_trainer import loss as losses
from rljob_trainer.checkpoint import (
    CheckpointManager,
    CheckpointSave,
    CommittedCheckpoint,
    acknowledge_covered,
    find_lost_checkpoint,
)
from rljob_trainer.loss_metrics import StepMetrics, token_entropy
from rljob_trainer.loading import load_model
from rljob_trainer.data_wait import DataWaitWindow
from rljob_trainer.metrics_registry import (CHECKPOINT_BLOCKING, CHECKPOINT_SAVE, COLLECTIVES, DATA_WAIT,
                                            DATA_WAIT_SHARE, DECODE, FORWARD_BACKWARD, GRAD_NORM, LEARNING_RATE,
                                            METRICS_UPDATE, OPTIMIZER, PACK, STEP_OTHER, STEP_PHASES, STEP_TIME,
                                            STREAM_COUNTERS, WEIGHT_SYNC, WEIGHT_SYNC_WAIT, DEAD_LETTERED_PREFIX)
from rljob_wire.model import build_tokenizer, sequence_logprobs
from rljob_trainer.parallel import DataParallelModel, Distributed, SmallReduction, start_reduce_small
from rljob_trainer.fence import claim, gang_attempt
from rljob_trainer.optim import build_optimizer, step_learning_rate
from rljob_trainer.progress_report import (Progress, build_progress, publish_checkpointed, publish_start,
                                          stream_identity)
from rljob_trainer.step_record import StepRecord
from rljob_trainer.stream.batch import MicroBatch, flat_from_padded, pack_columns
from rljob_trainer.stream.reader import StreamReader, ack_entries, trim_acked
from rljob_trainer.stream.redistribute import redistribute_pending
from rljob_trainer.weight_publisher import Publication, WeightPublisher, publish_weights
from rljob_wire.packed import DEFAULT_BUCKET_BYTES

log = logging.getLogger("rljob_trainer.train")  # the name the logs have always carried


@dataclass(frozen=True)
class RunResult:
    """How a run ended: optimizer steps done, documents that entered the loss, the export directory (rank 0)."""

    step: int
    documents_seen: int
    export_dir: Optional[Path]


class PhaseClock:
    """The wall-clock split of one step into named phases (milliseconds), by ``time.perf_counter`` on the host: no
    device synchronisation and no collective is added, so on a GPU a phase ends when the host has queued its work
    (metrics_registry's TIMINGS say where the device is waited for).

    :meth:`lap` charges the time since the previous lap (or the start) to a phase; :meth:`move` re-charges a part
    measured inside a lap (decoding inside the read, the metrics inside the micro-batch loop) to another phase.
    """

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1e3
        self._last = now

    def move(self, ms: float, source: str, target: str) -> None:
        self.ms[source] -= ms
        self.ms[target] = self.ms.get(target, 0.0) + ms

    def timings(self, **measured: float) -> dict[str, float]:
        """{phase: ms} of every :data:`STEP_PHASES` name (0 for a phase not lapped), ``measured`` phases (timed
        elsewhere, e.g. the publication's own duration) included, ``step_other_time_ms`` the rest of
        ``step_time_ms`` (the time since the start)."""
        total = (time.perf_counter() - self.start) * 1e3
        out = {**self.ms, **measured}
        out = {name: out.get(name, 0.0) for name in STEP_PHASES if name != STEP_OTHER}
        return {STEP_TIME: total, **out, STEP_OTHER: total - sum(out.values())}


class StepCounts(NamedTuple):
    """A step's counts summed over the data-parallel ranks."""

    labels: int
    """Labelled tokens (GRPO's normaliser)."""
    labelled_documents: int
    """Documents with a labelled token (GSPO's normaliser)."""
    documents: int
    """Documents (documents_seen grows by it)."""
    tokens: int
    """Tokens, prompts included (tokens_per_second)."""
    most_micro_batches: int
    """The most micro-batches any rank packed (FSDP's padding backwards)."""


class GlobalCounts:
    """A step's :class:`StepCounts`, from a reduction started before its first forward
    (:func:`~rljob_trainer.parallel.start_reduce_small` of [labelled tokens, documents with a labelled token,
    documents, tokens] int64 and [micro-batches packed]): :meth:`result` waits for it the first time, so the values
    travel while this rank computes, then calls ``then`` (the next step's read: only now does every rank hold its
    documents; a started collective proves nothing about the other ranks).

    Attributes:
        waited_ms: how long the wait and ``then`` took (milliseconds; 0 until then): the step's
            ``collectives_time_ms`` share.
    """

    def __init__(self, reduction: SmallReduction, then: Optional[Callable[[], None]] = None) -> None:
        self._reduction = reduction
        self._then = then
        self._counts: Optional[StepCounts] = None
        self.waited_ms = 0.0

    def result(self) -> StepCounts:
        """The counts, waiting for them the first time.

        Raises:
            RuntimeError: the collective failed or timed out; what ``then`` raises.
        """
        if self._counts is None:
            started = time.perf_counter()
            counts, most = self._reduction.wait()
            self._counts = StepCounts(*counts.tolist(), *([] if most is None else most.tolist()))
            if self._then is not None:
                self._then()
            self.waited_ms = (time.perf_counter() - started) * 1e3
        return self._counts


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
            raise ValueError("spec.trainer.batch." + rules.DOCUMENTS_PER_STEP_MESSAGE.text(
                documentsPerStep=spec.trainer.batch.documents_per_step, dataParallel=config.data_parallel_size,
                **topology_numbers(spec)))
        torch.manual_seed(spec.trainer.seed + where.rank)
        self.tokenizer = build_tokenizer(spec.model, spec.rollout.task)
        vocab_size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else self.tokenizer.vocab_size
        if where.is_rank_zero:  # this attempt owns the job's writes from here on (rljob_trainer.fence)
            claim(client, config.keys)
            log.info("stream identity %s", stream_identity(client, config))
        self.checkpoints = CheckpointManager(config, where, client, on_commit=self._after_commit)
        # Read once: a checkpoint to load (own or initFrom) makes the initial weights pointless, so none are read.
        self.start_from = self.checkpoints.resume_source()
        # float32 master weights built on the meta device: each rank allocates only its shards (fsdp) or its replica
        # (ddp) and fills them one tensor at a time; bf16 only in compute on GPU (precision.param). Collective.
        self.parallel: DataParallelModel = load_model(spec.model, vocab_size, spec.trainer.seed, where, spec.trainer,
                                                      weights=self.start_from[0] is None)
        self.model = self.parallel.model
        self.optimizer = build_optimizer(self.model, spec.trainer.optimizer)  # over the shards under fsdp
        self.corrections = losses.Corrections.from_algorithm(spec.algorithm)
        # The KL penalty's reference policy: spec.model's own weights (never a checkpoint's or initFrom's), sharded
        # like the trained model, evaluated without gradients. Collective.
        self.reference: Optional[DataParallelModel] = None
        if self.corrections.kl:
            self.reference = load_model(spec.model, vocab_size, spec.trainer.seed, where, spec.trainer, frozen=True)
        self.step = 0
        self.documents_seen = 0
        self.metrics = StepMetrics.from_config(config, device=where.device)
        self.data_wait = DataWaitWindow()
        self.publisher: Optional[WeightPublisher] = None
        self.overlaps_publication = not self.parallel.sharded and where.device.type == "cpu"
        """Whether a step's publication runs beside the next step (:meth:`train_step`): an unsharded model on CPU,
        whose publication runs no collective of the data-parallel group (gloo's groups may run on two threads; NCCL's
        may not, PyTorch's ``new_group``)."""
        self.publication_in_flight: Optional[Future[Publication]] = None
        """Rank 0: the last step's publication while it runs in the background (None once :meth:`fit` reported it)."""
        self.reader = StreamReader(
            client,
            config.keys,
            where.rank,
            config.data_parallel_size,
            micro_batch_tokens=spec.trainer.batch.micro_batch_tokens,
            require_metrics_fields=self.metrics.enabled,
            data_timeout_seconds=spec.trainer.data_timeout_seconds,
            vocab_size=self.model.get_input_embeddings().num_embeddings,
            max_staleness=spec.algorithm.max_staleness,
        )
        self._dropped_stale = 0
        """The step's reduced ``dropped_stale`` (all ranks, this attempt): the drops the next checkpoint covers."""
        self._dropped_at_checkpoint: dict[int, int] = {}
        """{step: dropped_stale} of the checkpoints saved and not yet committed (read by the commit thread)."""
        self._metrics_ms = 0.0
        """Milliseconds of this step's metrics updates so far (:meth:`_micro_batch_loss`), for ``metrics_time_ms``."""
        self.progress: Progress = build_progress(config, client, where.rank, stdout=stdout)

    # --- start and end ----------------------------------------------------------------------------
    def resume(self) -> Optional[CommittedCheckpoint]:
        """Load the checkpoint found at construction (the latest own one, else ``initFrom``), ack what it covers,
        publish where this attempt starts (warning about a lost checkpoint), spread the pending entries over the ranks
        and start the reader (:func:`start_reading`). Collective."""
        source, own = self.start_from
        committed = None
        if source is not None:
            committed = self.checkpoints.load(source, self.model, self.optimizer)
            self.step, self.documents_seen = committed.step, committed.documents_seen
            if own and self.where.is_rank_zero:
                acknowledge_covered(self.client, self.config, committed)
        if self.where.is_rank_zero:
            lost = find_lost_checkpoint(self.client, self.config, self.step)
            if lost is not None:
                log.warning("checkpoint: %s", protocol.lost_checkpoint_message(lost))
            publish_start(self.client, self.config, self.step, self.documents_seen, lost, attempt=gang_attempt())
        start_reading(self.reader, self.where)  # after the acks and publish_start above: it begins with a barrier
        if self.where.is_rank_zero:
            bucket_mb = self.config.spec.trainer.weight_sync_bucket_megabytes
            self.publisher = WeightPublisher(self.config, self.client, bucket_bytes=(
                DEFAULT_BUCKET_BYTES if bucket_mb is None else bucket_mb << 20))
        publication = self._publish()
        log.info("weights: start of the attempt published in %.0f ms", publication.duration_ms)
        return committed

    def fit(self) -> RunResult:
        """Train until ``maxSteps``, then checkpoint, export and announce ``training_finished``. Collective.

        Raises:
            rljob_trainer.checkpoint.CheckpointSaveFailed: a checkpoint save failed (raised at the next step, or at
                the end for the last one).
        """
        max_steps = self.config.spec.trainer.max_steps
        every = self.config.spec.trainer.checkpoint.every_steps
        while self.step < max_steps:
            record = self.train_step()
            timings: dict[str, float] = {}
            if self.step % every == 0 or self.step == max_steps:
                timings[CHECKPOINT_BLOCKING] = self.save_checkpoint().blocking_ms
            finished = self.checkpoints.wait() if self.step == max_steps else self.checkpoints.poll()
            if finished and finished[-1].save_ms is not None:  # rank 0; the newest if two finished since the last step
                timings[CHECKPOINT_SAVE] = finished[-1].save_ms
            pending, self.publication_in_flight = self.publication_in_flight, None
            self.progress.report(dataclasses.replace(record, metrics={**record.metrics, **timings}), pending)
        if self.publisher is not None:
            self.publisher.settle()  # the last publication, if it runs in the background
        self.progress.flush()  # the last step is in the progress hash before training_finished is announced
        export_dir = None
        if self.config.spec.trainer.export.safetensors:
            export_dir = self.checkpoints.export(self.model, self.tokenizer)
        if self.publisher is not None:
            self.publisher.finish(step=self.step, documents_seen=self.documents_seen)
        log.info("training finished at step %d (%d documents seen)", self.step, self.documents_seen)
        return RunResult(self.step, self.documents_seen, export_dir)

    def close(self) -> None:
        """Finish a checkpoint save still in flight (logging its failure), release the Prometheus endpoint and the
        weight publisher (idempotent)."""
        self.checkpoints.close()
        self.progress.close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def save_checkpoint(self) -> CheckpointSave:
        """Snapshot a checkpoint of this step covering the entries this rank consumed since the last one and start
        writing it (collective; waits for the previous save first). The commit and the acks follow in rank 0's
        commit thread (:meth:`_after_commit`)."""
        self._dropped_at_checkpoint[self.step] = self._dropped_stale  # before the save: its commit may be quick
        return self.checkpoints.save(self.step, self.documents_seen, self.model, self.optimizer,
                                     self.reader.take_pending_ids())

    def _after_commit(self, committed: CommittedCheckpoint) -> None:
        """Global rank 0's commit thread, once ``committed``'s commit file is durable: publish its documents_seen
        and the stale drops it covers (:func:`publish_checkpointed`: the rollout stops counting its entries as trained
        or dropped before they leave the pending list), XACK every rank's covered entries, then trim acked entries.
        Only the Redis client is used (thread-safe), never the reader's state."""
        publish_checkpointed(self.client, self.config, committed.documents_seen,
                             self._dropped_at_checkpoint.pop(committed.step, 0))
        ack_entries(self.client, self.config.keys, [e for ids in committed.covered_entry_ids.values() for e in ids])
        trim_acked(self.client, self.config.keys)

    def _publish(self) -> Publication:
        """The weights after ``self.step``, as version ``documents_seen``, in the compute dtype (``precision.param``:
        bfloat16 on GPU by default, so 2 bytes per parameter on the wire and in rank 0's late-joiner copy; float32 on
        CPU); collective (every rank calls it). Raises what :func:`publish_weights` raises (a failed gather)."""
        return publish_weights(self.model, self.publisher, step=self.step, documents_seen=self.documents_seen,
                               dtype=self.parallel.compute_dtype)

    # --- one step ---------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        """Read and train one optimizer step and publish the weights (collective); return its record, which
        :meth:`fit` reports after the step's checkpoint. See the module docstring."""
        clock = PhaseClock()
        self.data_wait.step_started()
        decoded = self.reader.decode_seconds
        # Exactly documents_per_rank (>= 1) valid documents: every rank has at least one micro-batch, so every
        # rank joins the gradient reduction of each backward.
        documents = self.reader.next_documents(self.documents_per_rank, documents_seen=self.documents_seen)
        clock.lap(DATA_WAIT)
        clock.move((self.reader.decode_seconds - decoded) * 1e3, DATA_WAIT, DECODE)
        started = time.monotonic()
        micro_batches = [
            mb.to(self.where.device)
            for mb in pack_columns(documents.columns, self.config.spec.trainer.batch.micro_batch_tokens)
        ]
        # Each micro-batch is segmented once (one device sync); the counts, the loss and the metrics share it.
        segments = [losses.segment_documents(mb.label_mask, mb.document_index) for mb in micro_batches]
        counts = torch.zeros(4, dtype=torch.int64, device=self.where.device)
        for mb, seg in zip(micro_batches, segments):
            sizes = counts.new_tensor([mb.num_documents, mb.num_tokens])
            counts += torch.cat([torch.stack([seg.num_labels, seg.num_documents]), sizes])
        clock.lap(PACK)
        # The normalisers, and the most micro-batches any rank packed: one collective, the step's only reduction
        # outside the metrics; it travels while the first micro-batch's forward runs (an unsharded model).
        # Once the counts arrived every rank holds its documents: the next step's read travels while this one computes.
        last = self.step + 1 == self.config.spec.trainer.max_steps
        step_counts = GlobalCounts(start_reduce_small(counts, counts.new_tensor([len(micro_batches)])),
                                   then=None if last else lambda: self.reader.prefetch(self.documents_per_rank))
        # FSDP reduce-scatters in every backward: a rank with fewer micro-batches (documents of other lengths) runs
        # padding backwards so that every rank calls as many collectives (DDP all-reduces in the last one only).
        padding = step_counts.result().most_micro_batches - len(micro_batches) if self.parallel.sharded else 0
        clock.lap(COLLECTIVES)

        self.parallel.module.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.where.device)
        self._metrics_ms = 0.0
        backwards = len(micro_batches) + padding
        for index, (mb, seg) in enumerate(zip(micro_batches, segments)):
            with self.parallel.micro_batch(last=index == backwards - 1):
                loss = self._micro_batch_loss(mb, seg, step_counts)
                losses.scale_for_gradient_mean(loss, self.where.world_size).backward()
            loss_sum += loss.detach().double()
        for index in range(len(micro_batches), backwards):
            with self.parallel.micro_batch(last=index == backwards - 1):
                self._padding_backward(micro_batches[-1])
        clock.lap(FORWARD_BACKWARD)
        clock.move(self._metrics_ms, FORWARD_BACKWARD, METRICS_UPDATE)
        if not self.parallel.sharded:  # waited for in the first micro-batch
            clock.move(step_counts.waited_ms, FORWARD_BACKWARD, COLLECTIVES)
        self.metrics.fold()
        clock.lap(METRICS_UPDATE)

        # Every rank, every step, whatever the level; before the optimizer step: a mixed-presence error raised here
        # (on every rank) leaves the weights untouched.
        totals = {"loss": loss_sum, **{name: self._stream_counter(name) for name in STREAM_COUNTERS}}
        reduction = self.metrics.start_reduce(totals=totals)  # travels while the gradients are clipped
        clock.lap(COLLECTIVES)
        opt = self.config.spec.trainer.optimizer
        grad_norm = self.parallel.clip_grad_norm(opt.grad_clip if opt.grad_clip > 0 else torch.inf)
        lr = step_learning_rate(self.step, opt, self.config.spec.trainer.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clock.lap(OPTIMIZER)
        reduced = reduction()
        clock.lap(COLLECTIVES)
        stream = {name: int(reduced.pop(name)) for name in STREAM_COUNTERS}
        stream = {name: n for name, n in stream.items() if n or not name.startswith(DEAD_LETTERED_PREFIX)}
        self._dropped_stale = stream["dropped_stale"]
        step_loss = reduced.pop("loss")
        if self.publisher is not None:
            self.publisher.settle()  # the last publication's late-joiner copy may still be reading the weights
        clock.lap(WEIGHT_SYNC_WAIT)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap(OPTIMIZER)
        elapsed = max(time.monotonic() - started, 1e-9)

        self.step += 1
        self.documents_seen += step_counts.result().documents
        published: dict[str, float] = {}
        layout = None
        if self.publisher is not None and self.overlaps_publication:
            self.publication_in_flight = self.publisher.in_background(self._publish)
            clock.lap(WEIGHT_SYNC)
        else:
            publication = self._publish()
            published[WEIGHT_SYNC], layout = publication.duration_ms, publication.layout
        wait_share = self.data_wait.waited(clock.ms[DATA_WAIT])
        record = StepRecord(
            step=self.step,
            documents_seen=self.documents_seen,
            model_version=self.documents_seen,
            tokens_per_second=step_counts.result().tokens / elapsed,
            metrics={"loss": step_loss, GRAD_NORM: float(grad_norm), LEARNING_RATE: lr, DATA_WAIT_SHARE: wait_share,
                     **reduced,
                     **clock.timings(**published)},
            stream=stream,
            weight_sync_layout=layout,
        )
        return record

    def _padding_backward(self, mb: MicroBatch) -> None:
        """A forward and backward of ``mb`` that adds nothing to the gradients (its log-probabilities × 0): the
        collectives of one micro-batch for a rank that packed fewer than another (:meth:`train_step`)."""
        with self.parallel.autocast():
            padded = sequence_logprobs(self.parallel.module, mb.input_ids, mb.attention_mask, self.temperature)
        (padded.sum() * 0.0).backward()

    def _micro_batch_loss(
        self, mb: MicroBatch, segments: losses.DocumentSegments, step_counts: GlobalCounts
    ) -> torch.Tensor:
        """This micro-batch's share of the step loss (global normaliser) and its metrics update, in one pass: the
        metrics read the loss's output (:class:`~rljob_trainer.loss.PolicyLossOutput`) and ``segments``."""
        full = self.metrics.enabled and self.metrics.level == "full"
        ref_logprobs = None
        if self.reference is not None:  # before the policy's forward: nothing of it is kept for the backward
            with torch.no_grad(), self.reference.autocast():
                ref_padded = sequence_logprobs(self.reference.module, mb.input_ids, mb.attention_mask, self.temperature)
            ref_logprobs = flat_from_padded(ref_padded, mb.attention_mask)  # [T] float32
        model: Callable[..., Any] = _LogitsTap(self.parallel.module) if full else self.parallel.module
        with self.parallel.autocast():
            padded = sequence_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature)  # [B, L] float32
        new_logprobs = flat_from_padded(padded, mb.attention_mask)  # [T]
        common = dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, segments=segments,
                      corrections=self.corrections, ref_logprobs=ref_logprobs)
        if self.config.spec.algorithm.loss == "grpo":
            output = losses.grpo_loss(
                new_logprobs, mb.old_logprobs, mb.advantages, mb.label_mask, mb.document_index,
                num_labels_in_batch=max(step_counts.result().labels, 1), **common,
            )
        else:
            output = losses.gspo_loss(
                new_logprobs, mb.old_logprobs, mb.advantages, mb.label_mask, mb.document_index,
                num_documents_in_batch=max(step_counts.result().labelled_documents, 1), **common,
            )
        if self.metrics.enabled:
            metrics_started = time.perf_counter()
            entropy = None
            if full:
                per_row = token_entropy(model.logits[:, :-1], temperature=self.temperature)  # [B*(L-1)]
                per_row = per_row.reshape(mb.input_ids.shape[0], -1)
                entropy = flat_from_padded(torch.nn.functional.pad(per_row, (1, 0)), mb.attention_mask)
            self.metrics.update(
                new_logprobs=new_logprobs,
                old_logprobs=mb.old_logprobs,
                advantages=mb.advantages,
                documents_seen=self.documents_seen,
                loss_output=output,
                reward=None if mb.rewards is None else mb.rewards[mb.document_index],
                model_version=mb.model_version,
                entropy=entropy,
            )
            self._metrics_ms += (time.perf_counter() - metrics_started) * 1e3
        return output.loss

    def _stream_counter(self, name: str) -> float:
        if name.startswith(DEAD_LETTERED_PREFIX):
            return float(self.reader.counters.dead_lettered[name.removeprefix(DEAD_LETTERED_PREFIX)])
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
