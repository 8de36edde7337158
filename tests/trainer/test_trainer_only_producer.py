"""A trainer-only job (spec.rollout.replicas 0) fed by producers outside rljob, end to end on a real Redis: a producer
that writes entries exactly as Fast-LLM's ``RedisStreamingDocumentData.to_message`` does (no ``model_version``, no
``reward``) and holds back by the consumer group's backlog (``redis.maxPending``), a real 2-rank trainer that trains to
maxSteps and checkpoints, and a weight member outside rljob that heartbeats in the members hash as the first transfer
rank above the rollout range and receives every update. Everything the outsiders use comes from ``status.stream``
(:func:`rljob_operator.job_status.stream_status` over the job's resolved config), as docs/trainer-only.md says.
With metrics on, such entries are dead-lettered with a counted reason and the trainer's data timeout names them."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file

from portutil import free_port
from rljob_api import protocol
from rljob_api.status import StreamStatus
from rljob_operator.job_status import stream_status
from rljob_trainer.checkpoint import COMMIT_FILE, committed_checkpoints
from rljob_trainer.metrics_registry import TIMINGS
from rljob_wire.model import DigitTokenizer
from rljob_trainer.stream.reader import DataTimeout
from rljob_trainer.train import run
from rljob_wire.transfer import StoreAddress, receive_update
from train_harness import (
    Torchrun,
    XackMonitor,
    json_lines,
    make_config,
    read_events,
    wait_for_commit,
    wait_until,
    write_config,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("no_torchrun_env")

TIMED = {t.name for t in TIMINGS}  # wall-clock figures (weight_sync_time_ms, the checkpoint timings)
PROMPT = 6
"""Prompt tokens of each document: <bos>, 4 digits, separator (their labels masked by the loss-masking span)."""


def fast_llm_message(tokens: np.ndarray, old_log_probabilities: np.ndarray, advantage: float) -> dict[str, Any]:
    """One stream entry as Fast-LLM's ``RedisStreamingDocumentData.to_message`` writes it: raw int64 token bytes, raw
    float32 log-probability bytes, and ``data`` as ``json.dumps`` of the loss-masking spans and the advantage (a str,
    as upstream hands it to redis-py)."""
    message: dict[str, Any] = {"tokens": tokens.astype(np.int64).tobytes()}
    message["old_log_probabilities"] = old_log_probabilities.astype(np.float32).tobytes()
    message["data"] = json.dumps({"loss_masking_spans": [[0, PROMPT]], "advantage": advantage})
    return message


def fast_llm_messages(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` digit-task documents (prompt of 4 digits, completion of 4) as Fast-LLM entries."""
    rng, tokenizer = np.random.default_rng(seed), DigitTokenizer()
    messages = []
    for _ in range(count):
        digits = "".join(str(d) for d in rng.integers(0, 10, 8))
        tokens = np.asarray(tokenizer.encode(digits[:4] + "|" + digits[4:]), dtype=np.int64)
        old = np.zeros(len(tokens), dtype=np.float32)
        old[PROMPT:] = rng.uniform(-3.0, -1.0, len(tokens) - PROMPT)
        messages.append(fast_llm_message(tokens, old, float(rng.normal())))
    return messages


def connect(stream: StreamStatus, password: str) -> redis.Redis:
    """A client of the job's Redis from status.stream's ``redisAddress`` (host:port/db) and the password Secret."""
    host_port, db = stream.redis_address.rsplit("/", 1)
    host, port = host_port.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), db=int(db), password=password, ssl=stream.tls)


class OutsideProducer:
    """Writes ``messages`` to status.stream's ``streamKey`` on a thread, each only while the consumer group's backlog
    (lag + pending, XINFO GROUPS; the stream length before the trainer created the group) is below ``max_pending``."""

    def __init__(self, stream: StreamStatus, password: str, messages: list[dict[str, Any]], max_pending: int):
        self.stream, self.client = stream, connect(stream, password)
        self.messages, self.max_pending = messages, max_pending
        self.ids: list[str] = []
        self.held = 0
        """Polls that found the backlog at the bound (the producer waited)."""
        self.largest_backlog = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="outside-producer", daemon=True)
        self._thread.start()

    def backlog(self) -> int:
        try:
            groups = self.client.xinfo_groups(self.stream.stream_key)
        except redis.ResponseError:  # no stream yet
            return 0
        group = next((g for g in groups if g["name"].decode() == self.stream.group), None)
        if group is None:
            return self.client.xlen(self.stream.stream_key)
        lag = group.get("lag")
        return (self.client.xlen(self.stream.stream_key) if lag is None else int(lag)) + int(group["pending"])

    def _run(self) -> None:
        try:
            for message in self.messages:
                while (backlog := self.backlog()) >= self.max_pending:
                    self.held += 1
                    time.sleep(0.05)
                self.largest_backlog = max(self.largest_backlog, backlog + 1)
                self.ids.append(self.client.xadd(self.stream.stream_key, message).decode())
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the producer wrote {len(self.ids)} of {len(self.messages)} entries"
        assert self.error is None, self.error


class OutsideMember:
    """A weight receiver outside rljob: heartbeats ``HSET membersKey <rank> {"time": Redis TIME, "version",
    "instance"}`` every 0.5 s, follows ``eventsKey`` from its end, and joins every weights_ready update whose ticket
    invites ``rank`` at ``weightsAddress``; stops at training_finished. ``received``: documents_seen → tensors."""

    def __init__(self, stream: StreamStatus, password: str, rank: int):
        self.stream, self.rank, self.client = stream, rank, connect(stream, password)
        host, port = stream.weights_address.rsplit(":", 1)
        self.address = StoreAddress(host, int(port))
        self.instance, self.version = uuid.uuid4().hex[:12], None
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        self.invited: list[tuple[int, ...]] = []
        self.finished = False
        self.error: Optional[BaseException] = None
        last = self.client.xrevrange(stream.events_key, count=1)
        self._cursor = last[0][0].decode() if last else "0-0"
        self._heartbeat()
        self._thread = threading.Thread(target=self._run, name="outside-member", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        seconds, micros = self.client.time()
        value = json.dumps({"time": seconds + micros / 1e6, "version": self.version, "instance": self.instance})
        self.client.hset(self.stream.members_key, str(self.rank), value)

    def _run(self) -> None:
        try:
            beat = time.monotonic()
            while not self.finished:
                if time.monotonic() - beat >= 0.5:
                    self._heartbeat()
                    beat = time.monotonic()
                for _, entries in self.client.xread({self.stream.events_key: self._cursor}, block=200) or []:
                    for entry_id, fields in entries:
                        self._cursor = entry_id.decode()
                        self._on(protocol.parse_event(self._cursor, fields))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error
        finally:
            self.client.hdel(self.stream.members_key, str(self.rank))

    def _on(self, event: protocol.Event) -> None:
        if event.type == protocol.EVENT_TRAINING_FINISHED:
            self.finished = True
        elif event.ticket is not None and self.rank in event.ticket.members:
            self.invited.append(event.ticket.members)
            tensors: dict[str, torch.Tensor] = {}
            if receive_update(self.address, event.ticket, self.rank, device=torch.device("cpu"),
                              sink=lambda name, tensor: tensors.__setitem__(name, tensor.clone())):
                self.received[event.documents_seen] = tensors
                self.version = event.documents_seen
                self._heartbeat()


def test_a_trainer_only_job_trains_on_fast_llm_entries_with_back_pressure_and_serves_weights_outside(
        redis_server, tmp_path):
    # documentsPerStep x everySteps = 8 = maxPending: the producer is held until the step-2 checkpoint acks 8 entries
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=3,
                         every_steps=2, metrics="none", max_pending=8, replicas=0)
    stream = stream_status(config, None)
    assert (stream.stream_key, stream.group, stream.first_transfer_rank) == ("fast_llm_streaming", "fast_llm_group", 1)
    messages = fast_llm_messages(12, seed=3)
    monitor = XackMonitor(redis_server)
    member = OutsideMember(stream, redis_server.password, stream.first_transfer_rank)
    producer = OutsideProducer(stream, redis_server.password, messages, max_pending=8)
    trainer = Torchrun(write_config(config, tmp_path / "config.json"), 2, free_port(), redis_server.password, tmp_path,
                       "trainer-only")
    try:
        assert trainer.wait(400) == 0, trainer.logs()
        producer.join(30)
        wait_until(lambda: member.finished or member.error, 30, "training_finished at the outside member")
    finally:
        trainer.kill()
        member.finished = True
    acks = monitor.stop()
    assert member.error is None, member.error
    client = redis_server.client()

    lines = json_lines(trainer)
    assert [(x["step"], x["documents_seen"], x["model_version"]) for x in lines] == [(1, 4, 4), (2, 8, 8), (3, 12, 12)]
    for line in lines:  # metrics none: the step's own values, no loss metric (no staleness or reward to read)
        assert set(line["metrics"]) - TIMED == {"loss", "grad_norm", "learning_rate"}
        assert np.isfinite(line["metrics"]["loss"])
        assert (line["stream"]["dead_lettered"], line["stream"]["dropped_too_long"]) == (0, 0)
    progress = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
    assert (progress["step"], progress["documents_seen"]) == ("3", "12")

    # Back-pressure: the producer never had more than maxPending unacknowledged entries, and had to wait for them.
    assert producer.held > 0 and producer.largest_backlog <= 8
    # Delivery: every entry in exactly one committed checkpoint, acked exactly once, nothing left pending.
    checkpoints = committed_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in checkpoints] == ["step-00000002", "step-00000003"]
    wait_for_commit(client, config, 3, trainer.logs)
    covered = [e for p in checkpoints for ids in json.loads((p / COMMIT_FILE).read_text())["covered_entry_ids"].values()
               for e in ids]
    assert sorted(covered) == sorted(producer.ids) and len(covered) == 12
    assert {entry: acks[entry] for entry in producer.ids} == {entry: 1 for entry in producer.ids}
    group = client.xinfo_groups(config.keys.stream)[0]
    assert (group["pending"], group["entries-read"]) == (0, 12)
    assert client.xlen(config.keys.dead_letter) == 0

    # Weights: the outside member was invited alone, got the initial weights and every update, the last = the export.
    assert read_events(client, config) == [
        {"type": "weights_ready", "step": s, "documents_seen": 4 * s} for s in range(4)
    ] + [{"type": "training_finished", "step": 3, "documents_seen": 12}]
    assert sorted(member.received) == [0, 4, 8, 12] and set(member.invited) == {(1,)}
    exported = load_file(Path(config.checkpoint_dir) / "export" / "model.safetensors")
    assert member.received[12].keys() == exported.keys()
    for name, value in exported.items():
        assert torch.equal(member.received[12][name], value), name


def test_with_metrics_on_fast_llm_entries_are_dead_lettered_with_a_counted_reason(redis_server, tmp_path):
    # Fast-LLM's writer sends no reward and no model_version, which the loss metrics need (DESIGN §4).
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=2, metrics="basic",
                         data_timeout_seconds=2, replicas=0)
    client = redis_server.client()
    for message in fast_llm_messages(3, seed=4):
        client.xadd(config.keys.stream, message)
    with pytest.raises(DataTimeout) as raised:
        run(config, client=client, stdout=io.StringIO())
    assert str(raised.value) == (
        "fast_llm_consumer_0: no valid document on stream 'fast_llm_streaming' for 2 s (have 0 of 2); refused 3 "
        "entries: missing_metrics_field ×3 dead-lettered to 'rljob:ns:job:dead_letter' (each with its reason)")
    letters = [fields for _, fields in client.xrange(config.keys.dead_letter)]
    assert [(f[b"kind"], f[b"reason"]) for f in letters] == [
        (b"missing_metrics_field", b"no `model_version` field while metrics are on")] * 3
    group = client.xinfo_groups(config.keys.stream)[0]
    assert group["pending"] == 0  # dead-lettered entries are acked: they hold no back-pressure


def test_entries_refused_by_kind_reach_the_progress_hash_and_the_operators_account(redis_server, tmp_path,
                                                                                    monkeypatch):
    """A producer writes 2 good entries per step and, among them, one with a token beyond the vocabulary and one
    whose ``data`` is not JSON: the trainer of attempt 3 trains its 2 steps, reports the refused entries by kind in the
    progress hash's ``stream`` beside its attempt, and the operator's account (rljob_operator.account) turns them into
    status.attempts[-1].documents and status.documentTotals, with a Warning EntriesRejected (2 of 6 entries read)."""
    from datetime import datetime, timezone

    from rljob_api.constants import Phase, Reason
    from rljob_api.status import RLTrainingJobStatus
    from rljob_operator import account, gang
    from rljob_operator.job_status import RedisHealth, build_status, transition_events

    monkeypatch.setenv("RLJOB_ATTEMPT", "3")
    monkeypatch.setenv("RLJOB_JOB_UID", "uid-1")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=2, max_steps=2,
                         metrics="none", replicas=0)
    client = redis_server.client()
    good = fast_llm_messages(4, seed=5)
    tokens = np.frombuffer(good[0]["tokens"], dtype=np.int64).copy()
    tokens[-1] = 10_000
    beyond = dict(good[0], tokens=tokens.tobytes())
    not_json = dict(good[1], data="{not json")
    for message in (good[0], beyond, good[1], not_json, good[2], good[3]):
        client.xadd(config.keys.stream, message)
    run(config, client=client, stdout=io.StringIO())

    progress = protocol.parse_progress(client.hgetall(config.keys.progress), {})
    assert (progress.started_attempt, progress.restored_from_step, progress.step) == (3, 0, 2)
    assert {k: v for k, v in progress.stream.items() if v} == {
        "dead_lettered": 2, "dead_lettered.bad_value": 1, "dead_lettered.bad_json": 1}

    started = gang.Lifecycle(phase=Phase.RUNNING, attempt=3, restarts=3, gang_created=True, reason=Reason.TRAINING,
                             message="attempt 3: the trainer pod is running")
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    common = dict(generation=1, lifecycle=started, problems=(), data_parallel_size=1,
                  redis=RedisHealth(True, "external Redis reachable"), pods=(), nodes=1, replicas=0, now=now)
    before = build_status(RLTrainingJobStatus(), progress=None, **common)
    after = build_status(before, progress=progress, **common)
    assert after.attempts[-1].documents.dead_lettered == {"bad_value": 1, "bad_json": 1}
    assert after.document_totals.dead_lettered == {"bad_value": 1, "bad_json": 1}
    assert [e.message for e in transition_events(before, after) if e.reason == "EntriesRejected"] == [
        "the trainer could not train 2 of the 6 entries read since the job began (33.3%): 2 dead-lettered "
        "(bad_json 1, bad_value 1); status.documentTotals keeps the counts"]
    assert account.rejected(after.document_totals) == 2
