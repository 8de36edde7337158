"""Kill a 2-rank trainer mid-run and restart it: every entry id is acked exactly once (counted with Redis
MONITOR), only after a committed checkpoint covers it, and entries trained after the last checkpoint are
redelivered and counted (DESIGN §6); the progress hash says what the rollout's max lag and the operator need
(checkpoint_documents_seen, restored_from_step, no checkpoint_lost)."""

from __future__ import annotations

from rljob_api.protocol import (
    PROGRESS_CHECKPOINT_DOCUMENTS_SEEN,
    PROGRESS_CHECKPOINT_LOST,
    PROGRESS_DOCUMENTS_SEEN,
    PROGRESS_RESTORED_FROM_STEP,
)
from train_harness import (
    Torchrun,
    XackMonitor,
    covered_by_checkpoint,
    free_port,
    json_lines,
    make_config,
    make_documents,
    read_events,
    run_until_step_then_kill,
    wait_until,
    write_config,
    write_documents,
)


def test_kill_and_restart_acks_every_entry_once_after_its_checkpoint(redis_server, tmp_path):
    config = make_config(
        redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=6, every_steps=2, keep_last=10
    )
    config_path = write_config(config, tmp_path / "config.json")
    client = redis_server.client()
    keys = config.keys
    docs = make_documents(24, seed=1)
    monitor = XackMonitor(redis_server)
    try:
        ids = write_documents(client, config, docs[:20])  # 5 steps: the trainer blocks reading step 6
        first = run_until_step_then_kill(config, config_path, 2, 5, redis_server, tmp_path, "first")

        # At the kill: checkpoints of steps 2 and 4 cover entries 0..15 and those are acked; the 4 entries of
        # step 5 were trained but no checkpoint covers them, so they are still pending.
        covered = covered_by_checkpoint(tmp_path / "ckpt")
        assert {step: sorted(c) for step, c in covered.items()} == {2: sorted(ids[:8]), 4: sorted(ids[8:16])}
        pending = {row["message_id"].decode() for row in client.xpending_range(keys.stream, keys.group, "-", "+", 100)}
        assert pending == set(ids[16:20])
        assert set(monitor.acks) == set(ids[:16])
        # What the rollout's max lag reads: 20 seen - 16 checkpointed = the 4 trained entries still pending.
        progress = client.hmget(keys.progress, [PROGRESS_DOCUMENTS_SEEN, PROGRESS_CHECKPOINT_DOCUMENTS_SEEN])
        assert progress == [b"20", b"16"]
        client.hset(keys.progress, PROGRESS_CHECKPOINT_LOST, "{}")  # as if an earlier start had lost a checkpoint

        # Redis drops the killed ranks' blocked XREADGROUPs once it sees their sockets close; entries written
        # before that would be delivered to the dead consumers (and merely redelivered later).
        wait_until(lambda: not any("b" in c["flags"] for c in client.client_list()), 30, "blocked clients gone")
        ids += write_documents(client, config, docs[20:])
        second = Torchrun(config_path, 2, free_port(), redis_server.password, tmp_path, "second")
        assert second.wait(240) == 0, second.logs()
        second.kill()
    finally:
        acks = monitor.stop()

    assert set(acks) == set(ids) and set(acks.values()) == {1}, acks  # each id acked exactly once
    covered = covered_by_checkpoint(tmp_path / "ckpt")
    assert sorted(covered) == [2, 4, 6]
    assert sorted(covered[6]) == sorted(ids[16:24])  # the redelivered step-5 entries land in checkpoint 6
    every = [entry for c in covered.values() for entry in c]
    assert sorted(every) == sorted(ids) and len(every) == len(set(every))
    group = client.xinfo_groups(keys.stream)[0]
    assert group["pending"] == 0

    before = json_lines(first)
    after = json_lines(second)
    assert [(x["step"], x["documents_seen"]) for x in before] == [(s, 4 * s) for s in range(1, 6)]
    assert [(x["step"], x["documents_seen"]) for x in after] == [(5, 20), (6, 24)]  # resumed from step 4
    assert [x["stream"]["redeliveries"] for x in after] == [4, 4]
    assert all(x["stream"]["redeliveries"] == 0 for x in before)

    events = read_events(client, config)
    ready = [(e["step"], e["documents_seen"]) for e in events if e["type"] == "weights_ready"]
    assert ready == [(s, 4 * s) for s in range(6)] + [(4, 16), (5, 20), (6, 24)]  # a start publishes the checkpoint's
    assert [e["type"] for e in events].count("training_finished") == 1 and events[-1] == {"type": "training_finished", "step": 6, "documents_seen": 24}

    # A start that finds its checkpoint says where it started and clears an earlier start's checkpoint_lost.
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    assert progress[PROGRESS_RESTORED_FROM_STEP] == "4" and PROGRESS_CHECKPOINT_LOST not in progress
    assert progress[PROGRESS_CHECKPOINT_DOCUMENTS_SEEN] == progress[PROGRESS_DOCUMENTS_SEEN] == "24"
