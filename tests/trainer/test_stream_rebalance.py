"""World-size changes of the stream's consumer group (DESIGN §5 rule 4, §6): the pending entries of the old
attempt's consumers are spread evenly over the current data-parallel ranks before any rank reads
(:func:`redistribute_pending`, :func:`rljob_trainer.trainer.start_reading`), against a real Redis.

- growth over real gloo ranks (1 → 2, 2 → 3), with rank 0 late so that only the barrier keeps the other ranks from
  reading first: each entry is read by exactly one rank, the shares differ by at most one;
- shrink 3 → 2 with real readers: no entry lost, the vanished consumer removed;
- any starting ownership (hypothesis), a part-way redistribution, deleted entries, foreign consumers, no group;
- a real run: DP 1 crashes holding maxPending pending entries with the rollout held at maxPending (the real
  :class:`DocumentWriter` bounds), restarts as DP 2 and finishes; every entry id is acked exactly once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection
from rljob_trainer.parallel import Distributed
from rljob_rollout.writer import DocumentWriter
from rljob_wire.codec import Document, encode_document
from rljob_trainer.stream.reader import StreamReader
from rljob_trainer.stream.redistribute import Redistribution, redistribute_pending
from train_harness import (
    Torchrun,
    XackMonitor,
    covered_by_checkpoint,
    free_port,
    init_gloo,
    json_lines,
    make_config,
    make_documents,
    run_ranks,
    run_until_step_then_kill,
    wait_until,
    write_config,
    write_documents,
)

torch.set_num_threads(1)
KEYS = resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host="unused")).keys


def write_docs(client, count: int) -> list[str]:
    """XADD ``count`` valid documents (4 tokens each); return their ids."""
    document = Document(
        tokens=np.arange(4, dtype=np.int64),
        old_log_probabilities=np.full(4, -0.5, np.float32),
        model_version=np.zeros(4, np.int64),
        loss_masking_spans=[(0, 1)],
        advantage=1.0,
        reward=1.0,
    )
    return [client.xadd(KEYS.stream, encode_document(document)).decode() for _ in range(count)]


def deliver(client, owners: list[int]) -> list[str]:
    """Write one entry per item of ``owners`` and deliver it (XREADGROUP) to consumer ``owners[i]``, in order, as
    the ranks of a crashed attempt would have read them; return the ids."""
    try:
        client.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    ids = write_docs(client, len(owners))
    for owner in owners:
        client.xreadgroup(KEYS.group, KEYS.consumer(owner), {KEYS.stream: ">"}, count=1)
    return ids


def owners(client, keys=KEYS) -> dict[str, list[str]]:
    """Pending entry ids by consumer name (id order)."""
    out: dict[str, list[str]] = {}
    for row in client.xpending_range(keys.stream, keys.group, "-", "+", 10_000):
        out.setdefault(row["consumer"].decode(), []).append(row["message_id"].decode())
    return out


def by_id(ids: list[str]) -> list[str]:
    """``ids`` in stream order."""
    return sorted(ids, key=lambda entry_id: tuple(int(part) for part in entry_id.split("-")))


def consumer_names(client) -> list[str]:
    return sorted(c["name"].decode() for c in client.xinfo_consumers(KEYS.stream, KEYS.group))


def reader(client, rank: int, size: int) -> StreamReader:
    return StreamReader(client, KEYS, rank, size, micro_batch_tokens=16, require_metrics_fields=True,
                        data_timeout_seconds=10.0, block_ms=100)


# --- real gloo ranks -----------------------------------------------------------------------------------
def start_worker(rank: int, world_size: int, tmp_dir: str, port: int, password: str, reads: list[int]) -> None:
    """One rank: join gloo, :func:`start_reading` (rank 0 late by 1 s), read ``reads[rank]`` documents, write the
    ids read and the redelivery count to ``tmp_dir/rank_{rank}.json``."""
    from rljob_trainer.trainer import start_reading

    init_gloo(rank, world_size, tmp_dir)
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    try:
        if rank == 0:
            time.sleep(1.0)  # without the barrier the other ranks would read before the redistribution
        mine = reader(client, rank, world_size)
        start_reading(mine, Distributed(rank, world_size, 0, torch.device("cpu"), "gloo"))
        got = [entry_id for entry_id, _ in mine.next_documents(reads[rank])]
        result = {"ids": got, "redeliveries": mine.counters.redeliveries}
        Path(f"{tmp_dir}/rank_{rank}.json").write_text(json.dumps(result))
    finally:
        client.close()
        torch.distributed.destroy_process_group()


def run_start(redis_server, tmp_path, world_size: int, reads: list[int]) -> list[dict]:
    run_ranks(start_worker, world_size, tmp_path, redis_server.port, redis_server.password, reads)
    return [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.timeout(120)
def test_one_consumer_is_spread_over_two_gloo_ranks(redis_server, client, tmp_path):
    pending = deliver(client, [0] * 7)  # a DP 1 attempt crashed holding 7 entries
    fresh = write_docs(client, 3)
    ranks = run_start(redis_server, tmp_path, 2, reads=[5, 5])
    # 7 = 4 + 3: rank 0 holds the most, so it keeps 4 (its newest) and gives its 3 oldest to rank 1.
    assert [r["redeliveries"] for r in ranks] == [4, 3]
    assert ranks[0]["ids"][:4] == pending[3:] and ranks[1]["ids"][:3] == pending[:3]
    assert by_id(ranks[0]["ids"][4:] + ranks[1]["ids"][3:]) == fresh
    every = ranks[0]["ids"] + ranks[1]["ids"]
    assert sorted(every) == sorted(pending + fresh) and len(every) == len(set(every))  # each entry exactly once


@pytest.mark.timeout(120)
def test_two_consumers_are_spread_over_three_gloo_ranks(redis_server, client, tmp_path):
    pending = deliver(client, [0, 1] * 4 + [0])  # a DP 2 attempt: rank 0 holds 5, rank 1 holds 4
    fresh = write_docs(client, 3)
    ranks = run_start(redis_server, tmp_path, 3, reads=[4, 4, 4])
    # 9 = 3 + 3 + 3: rank 0 gives its 2 oldest, rank 1 its oldest, all to the new rank 2.
    by_rank = [pending[0::2], pending[1::2]]
    assert [r["redeliveries"] for r in ranks] == [3, 3, 3]
    assert ranks[0]["ids"][:3] == by_rank[0][2:] and ranks[1]["ids"][:3] == by_rank[1][1:]
    assert ranks[2]["ids"][:3] == by_id(by_rank[0][:2] + by_rank[1][:1])
    assert by_id([r["ids"][3] for r in ranks]) == fresh
    every = [entry for r in ranks for entry in r["ids"]]
    assert sorted(every) == sorted(pending + fresh) and len(every) == len(set(every))


# --- one process ------------------------------------------------------------------------------------
def test_shrink_3_to_2_loses_no_entry(client):
    old = [reader(client, rank, 3) for rank in range(3)]
    write_docs(client, 9)
    held = [[entry_id for entry_id, _ in r.next_documents(3)] for r in old]  # crash before a checkpoint
    more = write_docs(client, 2)

    result = redistribute_pending(client, KEYS, 2)
    assert result == Redistribution(pending=9, moved=3, lost=0, removed_consumers=("fast_llm_consumer_2",))
    assert consumer_names(client) == ["fast_llm_consumer_0", "fast_llm_consumer_1"]
    new0, new1 = reader(client, 0, 2), reader(client, 1, 2)
    new1.start()
    new0.start()
    got0 = [entry_id for entry_id, _ in new0.next_documents(6)]  # 5 redelivered + 1 new
    got1 = [entry_id for entry_id, _ in new1.next_documents(5)]  # 4 redelivered + 1 new
    # Rank 2's entries go to the rank furthest below its share (rank 0: 5 = 3 + 2, rank 1: 4 = 3 + 1).
    assert got0[:5] == held[0] + held[2][:2] and got1[:4] == held[1] + held[2][2:]
    assert by_id([got0[5], got1[4]]) == more
    assert (new0.counters.redeliveries, new1.counters.redeliveries) == (5, 4)
    assert sorted(got0 + got1) == sorted(sum(held, []) + more)


def test_part_way_redistribution_is_finished_by_the_next_and_a_balanced_group_stays(client):
    ids = deliver(client, [0] * 8)
    # What a redistribution to 4 ranks that died after its first XCLAIM leaves: 2 entries with rank 3 already.
    client.xclaim(KEYS.stream, KEYS.group, KEYS.consumer(3), 0, ids[5:7], justid=True)
    result = redistribute_pending(client, KEYS, 4)
    assert (result.pending, result.moved) == (8, 4)  # rank 0 gives 4 of its 6, rank 3 already has its 2
    assert owners(client) == {
        "fast_llm_consumer_0": [ids[4], ids[7]],
        "fast_llm_consumer_1": [ids[0], ids[2]],
        "fast_llm_consumer_2": [ids[1], ids[3]],
        "fast_llm_consumer_3": ids[5:7],
    }
    assert redistribute_pending(client, KEYS, 4) == Redistribution(pending=8, moved=0, lost=0, removed_consumers=())

    # Shares that differ by one stay where they are, whichever ranks hold the extra entries (here 1, 1, 2, 2).
    client.xack(KEYS.stream, KEYS.group, ids[4], ids[0])
    before = owners(client)
    assert redistribute_pending(client, KEYS, 4).moved == 0 and owners(client) == before


def test_entries_deleted_from_the_stream_are_counted_lost(client):
    ids = deliver(client, [0] * 4)
    client.xdel(KEYS.stream, ids[0])  # one of the two entries rank 0 gives away
    result = redistribute_pending(client, KEYS, 2)
    assert (result.moved, result.lost) == (1, 1)
    assert owners(client) == {"fast_llm_consumer_0": ids[2:], "fast_llm_consumer_1": [ids[1]]}


def test_no_group_and_foreign_consumers(client):
    assert redistribute_pending(client, KEYS, 3) == Redistribution(pending=0, moved=0, lost=0, removed_consumers=())
    ids = deliver(client, [1, 1])
    client.xclaim(KEYS.stream, KEYS.group, "someone_else", 0, ids[:1], justid=True)
    assert redistribute_pending(client, KEYS, 2).moved == 0  # 1 entry: rank 1 keeps it
    assert owners(client) == {"someone_else": ids[:1], "fast_llm_consumer_1": ids[1:]}
    with pytest.raises(ValueError, match="dp_size=0"):
        redistribute_pending(client, KEYS, 0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(holders=st.lists(st.integers(0, 5), max_size=20), dp_size=st.integers(1, 4))
def test_any_ownership_ends_balanced_with_the_fewest_moves(client, holders, dp_size):
    client.flushall()
    ids = deliver(client, holders)
    result = redistribute_pending(client, KEYS, dp_size)

    after = owners(client)
    assert sorted(entry for entries in after.values() for entry in entries) == sorted(ids)  # each once, none lost
    counts = [len(after.get(KEYS.consumer(rank), [])) for rank in range(dp_size)]
    assert sum(counts) == len(ids) and max(counts) - min(counts) <= 1, counts
    assert all(int(name.rsplit("_", 1)[1]) < dp_size for name in consumer_names(client))
    # The fewest moves: every rank keeps min(held, share) and as many ranks as possible keep one more.
    held = [holders.count(rank) for rank in range(dp_size)]
    share, extra = divmod(len(ids), dp_size)
    keep = sum(min(h, share) for h in held) + min(extra, sum(h > share for h in held))
    assert result.moved == len(ids) - keep and result.pending == len(ids)
    assert redistribute_pending(client, KEYS, dp_size).moved == 0 and owners(client) == after


# --- a real run across a world-size change ------------------------------------------------------------
class HeldRollout:
    """A rollout worker on a thread: writes ``documents`` one at a time whenever the real
    :class:`DocumentWriter` bounds allow it (backlog < maxPending and ahead < max(maxLag, documentsPerStep))."""

    def __init__(self, client, config, documents):
        self.client = client
        self.stream = config.keys.stream
        self.writer = DocumentWriter(client, config, replica_index=0)
        self.documents = list(documents)
        self.written: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self.documents and not self._stop.is_set():
            if self.writer.wait_reason() is None:
                self.writer.write([self.documents.pop(0)])
                self.written.append(self.client.xrevrange(self.stream, count=1)[0][0].decode())  # the only writer
            else:
                time.sleep(0.05)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(30)
        return self.written


@pytest.mark.timeout(300)
def test_dp1_crash_at_max_pending_restarts_as_dp2_without_stalling(redis_server, tmp_path):
    common = dict(documents_per_step=4, every_steps=2, max_steps=6, max_pending=8, max_lag=0)
    one = make_config(redis_server, tmp_path / "ckpt", processes=1, **common)
    two = make_config(redis_server, tmp_path / "ckpt", processes=2, data_timeout_seconds=20, **common)
    client = redis_server.client()
    keys = one.keys
    docs = make_documents(24, seed=5)
    monitor = XackMonitor(redis_server)
    try:
        ids = write_documents(client, one, docs[:12])  # 3 steps: the DP 1 rank blocks reading step 4
        run_until_step_then_kill(one, write_config(one, tmp_path / "one.json"), 1, 3, redis_server, tmp_path, "one")
        wait_until(lambda: not any("b" in c["flags"] for c in client.client_list()), 30, "blocked clients gone")
        # The killed rank had also read ahead the next step's 4 entries (DP 1 reads ahead): it held maxPending = 8.
        ids += write_documents(client, one, docs[12:16])
        client.xreadgroup(keys.group, keys.consumer(0), {keys.stream: ">"}, count=4)
        assert owners(client, keys) == {keys.consumer(0): ids[8:16]}
        rollout = HeldRollout(client, two, docs[16:])
        assert rollout.writer.wait_reason().startswith("backlog 8 (0 undelivered + 8 pending) >= spec.redis.maxPending")

        two_path = write_config(two, tmp_path / "two.json")
        second = Torchrun(two_path, 2, free_port(), redis_server.password, tmp_path, "two")
        assert second.wait(180) == 0, second.logs()  # a starved rank 1 would exit with DataTimeout after 20 s
        second.kill()
        ids += rollout.stop()
    finally:
        acks = monitor.stop()

    assert len(ids) == 24
    assert set(acks) == set(ids) and set(acks.values()) == {1}, acks  # each id acked exactly once
    covered = covered_by_checkpoint(tmp_path / "ckpt")
    assert {step: sorted(c) for step, c in covered.items()} == {
        2: sorted(ids[:8]), 4: sorted(ids[8:16]), 6: sorted(ids[16:])
    }
    assert client.xinfo_groups(keys.stream)[0]["pending"] == 0
    assert [c["name"].decode() for c in client.xinfo_consumers(keys.stream, keys.group)] == [
        keys.consumer(0), keys.consumer(1)
    ]
    lines = json_lines(second)
    assert [(x["step"], x["documents_seen"]) for x in lines] == [(3, 12), (4, 16), (5, 20), (6, 24)]
    assert {x["stream"]["redeliveries"] for x in lines} == {8}  # 4 re-read by each rank

