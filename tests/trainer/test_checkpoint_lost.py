"""A trainer start that finds the checkpoint Redis records gone from its volume (an emptyDir after a gang restart or
suspend): it warns, publishes ``checkpoint_lost``, starts from step 0 and, fed by two rollout writers that keep to
max lag, trains through the redelivered entries to the end instead of stalling (B1)."""

from __future__ import annotations

import io
import json
import logging
import shutil
import threading

import pytest
import torch

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.protocol import LostCheckpoint, lost_checkpoint_message
from rljob_trainer.checkpoint import COMMIT_FILE, find_lost_checkpoint, step_dir
from rljob_rollout.writer import DocumentWriter
from rljob_trainer.stream.reader import DataTimeout
from rljob_trainer import fence
from rljob_trainer.fence import gang_attempt
from rljob_trainer.progress_report import publish_start
from rljob_trainer.train import run
from train_harness import make_config, make_documents

torch.set_num_threads(1)

GONE = ("was lost: an emptyDir checkpoint volume does not survive a gang restart or suspend (set "
        "spec.trainer.checkpoint.volume to a PersistentVolumeClaim), and a claim's data can be replaced or cleaned")


pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def test_find_lost_checkpoint_compares_the_redis_record_with_the_volume(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    assert find_lost_checkpoint(client, config, 0) is None  # nothing recorded: a first start
    path = step_dir(tmp_path / "ckpt", 5)
    client.hset(config.keys.checkpoint, mapping={"step": 5, "documents_seen": 20, "path": str(path)})
    lost = find_lost_checkpoint(client, config, 0)
    assert lost == LostCheckpoint(step=5, path=str(path), restored_from_step=0)
    assert lost_checkpoint_message(lost) == f"the trainer started over at step 0: checkpoint step 5 ({path}) {GONE}"
    older = find_lost_checkpoint(client, config, 2)  # an older one survived
    assert lost_checkpoint_message(older).startswith("the trainer started over at step 2: checkpoint step 5")
    assert find_lost_checkpoint(client, config, 5) is None  # the start is not behind the record
    path.mkdir(parents=True)
    (path / COMMIT_FILE).write_text("{}")
    assert find_lost_checkpoint(client, config, 0) is None  # still on the volume
    client.hset(config.keys.checkpoint, "step", "five")
    with pytest.raises(ValueError, match=f"Redis hash {config.keys.checkpoint}: step 'five' is not an integer"):
        find_lost_checkpoint(client, config, 0)


def test_a_lost_checkpoint_is_reported_and_the_restart_trains_through_without_stalling(
    redis_server, tmp_path, caplog, monkeypatch
):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=10,
                         every_steps=5, data_timeout_seconds=3)
    spec = config.spec.model_copy(update={
        "rollout": config.spec.rollout.model_copy(update={"max_lag": 4}),  # max(maxLag, documentsPerStep) = 4
        "redis": config.spec.redis.model_copy(update={"max_pending": 20}),  # = documentsPerStep × everySteps
    })
    config = config.model_copy(update={"spec": spec})
    client = redis_server.client()
    keys = config.keys

    # Attempt 0: 32 documents, 8 steps, a checkpoint at step 5 (20 entries acked), then no more data: it fails.
    DocumentWriter(client, config, 0).write(make_documents(32, seed=3))
    with pytest.raises(DataTimeout):
        run(config, client=client, stdout=io.StringIO())
    assert client.hget(keys.checkpoint, "step") == b"5"
    assert client.xinfo_groups(keys.stream)[0]["pending"] == 12  # steps 6-8: trained, not covered by a checkpoint
    # The gang restarts on an empty checkpoint volume (emptyDir), as attempt 1.
    shutil.rmtree(tmp_path / "ckpt")
    monkeypatch.setenv(c.ENV_ATTEMPT, "1")
    client.hset(keys.rollout, mapping={"reward_sum:32": "3", "reward_count:32": "4", "reward_sum:0": "1.5", "reward_count:0": "2"})

    # Two rollout workers write whenever back-pressure and max lag let them, from attempt 1's start on.
    stop = threading.Event()
    written = [0, 0]
    errors: list[BaseException] = []

    def rollout(replica: int) -> None:
        try:
            writer = DocumentWriter(redis_server.client(), config, replica)
            while not stop.is_set() and client.hget(keys.progress, protocol.PROGRESS_CHECKPOINT_LOST) is None:
                stop.wait(0.01)
            while not stop.is_set():
                if writer.wait_reason() is None:
                    writer.write(make_documents(2, seed=100 + written[replica] + 1000 * replica))
                    written[replica] += 2
                else:
                    stop.wait(0.01)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=rollout, args=(r,), daemon=True) for r in (0, 1)]
    for thread in threads:
        thread.start()
    out = io.StringIO()
    caplog.set_level(logging.WARNING, logger="rljob_trainer.train")
    try:
        result = run(config, client=client, stdout=out)  # before the fix: DataTimeout at step 4
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors

    assert (result.step, result.documents_seen) == (10, 40)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["step"], x["documents_seen"]) for x in lines] == [(s, 4 * s) for s in range(1, 11)]  # from step 0
    assert {x["stream"]["redeliveries"] for x in lines} == {12}  # the 12 pending entries trained again
    path = step_dir(tmp_path / "ckpt", 5)
    message = f"started over at step 0: checkpoint step 5 ({path}) {GONE}"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"checkpoint: the trainer {message}"]
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    assert json.loads(progress[protocol.PROGRESS_CHECKPOINT_LOST]) == {
        "step": 5, "path": str(path), "restored_from_step": 0, "message": f"attempt 1 {message}", "attempt": 1,
    }
    assert progress[protocol.PROGRESS_RESTORED_FROM_STEP] == "0"
    assert progress[protocol.PROGRESS_STARTED_ATTEMPT] == "1"  # the operator's Starting ends on it (Running)
    assert progress[protocol.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN] == "40"  # the final checkpoint's
    assert client.hget(keys.checkpoint, "step") == b"10"
    rewards = {k: v for k, v in client.hgetall(keys.rollout).items() if k.startswith(b"reward_")}
    assert rewards == {b"reward_sum:0": b"1.5", b"reward_count:0": b"2"}  # attempt 0's version 32 went at the start

    # Both workers wrote; max lag held: once the trainer finished, at most 3 + one batch per worker is not trained
    # (undelivered, or read ahead and pending; without the bound the workers would have gone on to maxPending = 20).
    group = client.xinfo_groups(keys.stream)[0]
    assert all(written) and sum(written) == 28 + group["pending"] + group["lag"], (written, group)
    assert group["pending"] + group["lag"] <= 3 + 2 * 2, group


def test_a_start_drops_the_rollout_rewards_of_an_abandoned_timeline(redis_server, tmp_path):
    # The last attempt reached version 48; this one restarts from the checkpoint at step 4 = 16 documents.
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    keys = config.keys
    rewards = {f"{prefix}{v}": str(v) for v in (0, 8, 16, 32, 48) for prefix in ("reward_sum:", "reward_count:")}
    others = {"reward": "0.5", "reward_version": "48", "samples_generated": "80", "reward_errors:KeyError": "2",
              "reward_sum:latest": "1.0", "worker:0": '{"version": 48}'}
    client.hset(keys.rollout, mapping={**rewards, **others})
    client.hset(keys.progress, mapping={"step": 12, "documents_seen": 48, "model_version": 48, "metrics": "{}",
                                        "attempt": 1, "stream": '{"redeliveries": 5}'})  # attempt 1's last step

    lost = LostCheckpoint(step=12, path="/ckpt/step-00000012", restored_from_step=4)
    fence.claim(client, keys, attempt=2)  # as rank 0 of attempt 2 does first
    publish_start(client, config, 4, 16, lost, attempt=2)

    rollout = {k.decode(): v.decode() for k, v in client.hgetall(keys.rollout).items()}
    kept = {name: value for name, value in rewards.items() if int(name.split(":")[1]) <= 16}
    assert rollout == {**kept, **others}
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    assert (progress["step"], progress["documents_seen"], progress["model_version"]) == ("4", "16", "16")
    assert (progress[protocol.PROGRESS_RESTORED_FROM_STEP], progress[protocol.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN]) == ("4", "16")
    assert json.loads(progress[protocol.PROGRESS_CHECKPOINT_LOST])["attempt"] == 2 and progress["metrics"] == "{}"
    # the hash names the attempt that started; its reader counters come with its first step, none before
    assert progress[protocol.PROGRESS_STARTED_ATTEMPT] == "2" and protocol.PROGRESS_STREAM not in progress
    parsed = protocol.parse_progress(client.hgetall(keys.progress), {})
    assert (parsed.started_attempt, parsed.restored_from_step, parsed.stream) == (2, 4, {})

    publish_start(client, config, 0, 0, None)  # a start over: only version 0 stays; an empty hash is no error
    assert sorted(k.decode() for k in client.hkeys(keys.rollout)) == sorted(["reward_sum:0", "reward_count:0", *others])
    assert not client.hexists(keys.progress, protocol.PROGRESS_CHECKPOINT_LOST)
    client.delete(keys.rollout)
    publish_start(client, config, 0, 0, None)
    assert not client.exists(keys.rollout)


@pytest.mark.parametrize(("value", "attempt"), [("3", 3), ("0", 0), ("three", None), (None, None)])
def test_the_gang_attempt_comes_from_the_operator_env(monkeypatch, value, attempt):
    if value is None:
        monkeypatch.delenv(c.ENV_ATTEMPT, raising=False)
    else:
        monkeypatch.setenv(c.ENV_ATTEMPT, value)
    assert gang_attempt() == attempt
