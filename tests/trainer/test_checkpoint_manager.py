"""CheckpointManager in one process (a world of one over gloo): save/commit/prune, load, export, initFrom, the
resume-time ack of covered entries against a real Redis, and the asynchronous save: the snapshot of the moment of
save(), a write the OS refuses and a failing commit hook raised by wait()."""

from __future__ import annotations

import json
import os
import resource
import signal
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from rljob_trainer.checkpoint import (
    COMMIT_FILE,
    CheckpointManager,
    CheckpointSaveFailed,
    CommittedCheckpoint,
    acknowledge_covered,
    committed_checkpoints,
    resolve_init_from,
    step_dir,
    waits_for_write,
)
from rljob_wire.model import DigitTokenizer, build_model
from rljob_trainer.parallel import init_distributed, shutdown_distributed, wrap_model
from train_harness import make_config, make_documents, write_documents

torch.set_num_threads(1)


@pytest.fixture()
def world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    shutdown_distributed()


@contextmanager
def files_limited_to(size_bytes):
    """Files of this process may not grow beyond ``size_bytes`` (EFBIG instead of SIGXFSZ) inside the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def model_and_optimizer(config, seed=0):
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_one_step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, DigitTokenizer().vocab_size, (2, 8), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_save_commit_prune_and_load_round_trip(redis_server, tmp_path, world_of_one):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, keep_last=2)
    where = init_distributed(config)
    client = redis_server.client()
    manager = CheckpointManager(config, where, client)
    model, optimizer = model_and_optimizer(config)
    # An uncommitted leftover below the newest checkpoint (a crashed save) is pruned.
    (step_dir(manager.root, 2)).mkdir(parents=True)
    for step in (1, 3, 4):
        train_one_step(model, optimizer, step)
        manager.save(step, step * 10, model, optimizer, [f"{step}-0", f"{step}-1"])
    finished = manager.wait()
    assert [f.checkpoint.step for f in finished] == [1, 3, 4]  # 1 finished inside save(3), 3 inside save(4)
    assert all(f.save_ms >= f.blocking_ms > 0 for f in finished)
    committed = finished[-1].checkpoint
    assert [p.name for p in committed_checkpoints(manager.root)] == ["step-00000003", "step-00000004"]
    assert not step_dir(manager.root, 1).exists() and not step_dir(manager.root, 2).exists()
    on_disk = json.loads((step_dir(manager.root, 4) / COMMIT_FILE).read_text())
    assert on_disk["step"] == 4 and on_disk["documents_seen"] == 40 and on_disk["world_size"] == 1
    assert on_disk["covered_entry_ids"] == {"fast_llm_consumer_0": ["4-0", "4-1"]}
    assert committed.num_covered == 2
    record = client.hgetall(config.keys.checkpoint)
    assert int(record[b"step"]) == 4 and record[b"path"].decode() == str(step_dir(manager.root, 4))

    source, own = manager.resume_source()
    assert (source, own) == (step_dir(manager.root, 4), True)
    rng_after_save = torch.get_rng_state()
    torch.manual_seed(1234)
    fresh_model, fresh_optimizer = model_and_optimizer(config, seed=99)
    loaded = manager.load(source, fresh_model, fresh_optimizer)
    assert (loaded.step, loaded.documents_seen) == (4, 40)
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    a_state, b_state = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert a_state.keys() == b_state.keys()
    for key in a_state:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a_state[key][field], b_state[key][field]), (key, field)
    # The loaded pair keeps training identically to the original.
    train_one_step(model, optimizer, 7)
    train_one_step(fresh_model, fresh_optimizer, 7)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_export_is_hugging_face_safetensors(redis_server, tmp_path, world_of_one):
    from transformers import AutoModelForCausalLM

    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    where = init_distributed(config)
    model, optimizer = model_and_optimizer(config)
    train_one_step(model, optimizer, 0)
    out = CheckpointManager(config, where).export(model)
    assert (out / "config.json").is_file()
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["lm_head.weight"], model.state_dict()["lm_head.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def test_init_from_used_only_without_own_checkpoint(redis_server, tmp_path, world_of_one):
    source_config = make_config(redis_server, tmp_path / "other-job", processes=1)
    where = init_distributed(source_config)
    model, optimizer = model_and_optimizer(source_config)
    source = CheckpointManager(source_config, where)
    source.save(5, 50, model, optimizer, ["9-0"])
    source.close()

    config = make_config(redis_server, tmp_path / "ckpt", processes=1, init_from=str(tmp_path / "other-job"))
    manager = CheckpointManager(config, where)
    assert manager.resume_source() == (step_dir(tmp_path / "other-job", 5), False)
    manager.save(6, 60, model, optimizer, [])
    assert [f.checkpoint.step for f in manager.wait()] == [6]
    assert manager.resume_source() == (step_dir(tmp_path / "ckpt", 6), True)

    assert resolve_init_from(str(step_dir(tmp_path / "other-job", 5))) == step_dir(tmp_path / "other-job", 5)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="spec.trainer.checkpoint.initFrom: .*empty"):
        resolve_init_from(str(tmp_path / "empty"))


def test_acknowledge_covered_acks_only_still_pending_covered_entries(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    keys = config.keys
    client.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
    ids = write_documents(client, config, make_documents(6, seed=0))
    client.xreadgroup(keys.group, keys.consumer(0), {keys.stream: ">"}, count=6)
    client.xack(keys.stream, keys.group, ids[0], ids[1])  # acked before the crash
    committed = CommittedCheckpoint("x", 2, 4, 2, {"fast_llm_consumer_0": ids[:2], "fast_llm_consumer_1": ids[2:4]})
    assert acknowledge_covered(client, config, committed) == 2
    pending = [row["message_id"].decode() for row in client.xpending_range(keys.stream, keys.group, "-", "+", 10)]
    assert pending == ids[4:]
    assert acknowledge_covered(client, config, committed) == 0


def test_acknowledge_covered_on_a_redis_without_the_group_acks_nothing(redis_server, tmp_path):
    """A resume against a new Redis (the job re-created, its checkpoint volume kept): nothing is pending there."""
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    committed = CommittedCheckpoint("x", 2, 4, 1, {"fast_llm_consumer_0": ["1-0", "2-0"]})
    assert acknowledge_covered(client, config, committed) == 0  # no stream
    client.xadd(config.keys.stream, {"x": "1"})
    assert acknowledge_covered(client, config, committed) == 0  # a stream, no group
    assert client.xinfo_groups(config.keys.stream) == []


def test_the_snapshot_is_taken_at_save_and_training_continues_meanwhile(redis_server, tmp_path, world_of_one):
    """The files hold the state of the moment save() returned, although the model and optimizer change right after
    (the write runs in the background from a host copy)."""
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    where = init_distributed(config)
    committed = []
    manager = CheckpointManager(config, where, redis_server.client(), on_commit=committed.append)
    model, optimizer = model_and_optimizer(config)
    train_one_step(model, optimizer, 1)
    snapshot = {name: value.clone() for name, value in model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    started = manager.save(2, 20, model, optimizer, ["5-0"])
    train_one_step(model, optimizer, 2)  # while the save may still be writing
    (finished,) = manager.wait()
    assert manager.wait() == [] and manager.poll() == []  # reported once
    assert finished.checkpoint.step == 2 and finished.checkpoint.committed_at > 0
    assert 0 < started.blocking_ms <= finished.save_ms
    assert [c.covered_entry_ids for c in committed] == [{"fast_llm_consumer_0": ["5-0"]}]  # on_commit ran once
    assert (step_dir(manager.root, 2) / COMMIT_FILE).is_file()

    fresh_model, fresh_optimizer = model_and_optimizer(config, seed=99)
    manager.load(step_dir(manager.root, 2), fresh_model, fresh_optimizer)
    for name, value in fresh_model.state_dict().items():
        assert torch.equal(value, snapshot[name]), name
        assert not torch.equal(value, model.state_dict()[name]), name  # the live model moved on
    for key, state in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[key]), key
    manager.close()


def test_a_small_sharded_state_is_written_before_save_returns_on_cpu(redis_server, tmp_path, world_of_one, monkeypatch):
    """On CPU a sharded (fsdp) state of at most WAITED_WRITE_MAX_BYTES is written before save() returns (its DCP
    metadata, the upload's last file, is on disk); an unsharded state or a larger one is written beside the steps."""
    import rljob_trainer.checkpoint as checkpoint

    config = make_config(redis_server, tmp_path / "ckpt", processes=1, parallelism={"strategy": "fsdp"})
    where = init_distributed(config)
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, 0)
    plain = {name: value.clone() for name, value in model.state_dict().items()}
    sharded = wrap_model(model, where, config.spec.trainer).model
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    train_one_step(sharded, optimizer, 1)
    size = sum(t.numel() * t.element_size() for t in sharded.state_dict().values())
    assert waits_for_write(1, sharded.state_dict(), {"state": {}}) and not waits_for_write(1, plain, {"state": {}})
    monkeypatch.setattr(checkpoint, "WAITED_WRITE_MAX_BYTES", size - 1)
    assert not waits_for_write(1, sharded.state_dict()) and waits_for_write(2, sharded.state_dict())
    monkeypatch.undo()

    manager = CheckpointManager(config, where, redis_server.client())
    manager.save(2, 20, sharded, optimizer, ["5-0"])
    assert (step_dir(manager.root, 2) / ".metadata").is_file()
    assert [f.checkpoint.step for f in manager.wait()] == [2]

    # A write the OS refuses fails that save at wait(), as a background write's failure does.
    with files_limited_to(16 * 1024):
        manager.save(3, 30, sharded, optimizer, ["6-0"])
        with pytest.raises(CheckpointSaveFailed, match=r"checkpoint of step 3 \(.*step-00000003\) failed"):
            manager.wait()
    assert not (step_dir(manager.root, 3) / COMMIT_FILE).exists()
    manager.close()


def test_a_failed_write_is_raised_and_commits_nothing(redis_server, tmp_path, world_of_one):
    """A write the OS refuses (files limited to 16 KiB: the RNG file fits, the model and optimizer do not) fails the
    save at wait(): no commit file, no Redis record, on_commit not called; the next save commits and prunes it."""
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    where = init_distributed(config)
    client = redis_server.client()
    committed = []
    manager = CheckpointManager(config, where, client, on_commit=committed.append)
    model, optimizer = model_and_optimizer(config)
    train_one_step(model, optimizer, 1)
    with files_limited_to(16 * 1024):
        manager.save(2, 20, model, optimizer, ["5-0"])
        with pytest.raises(CheckpointSaveFailed, match=r"checkpoint of step 2 \(.*step-00000002\) failed") as failed:
            manager.wait()
    assert "File too large" in repr(failed.value.__cause__)
    assert not (step_dir(manager.root, 2) / COMMIT_FILE).exists() and committed == []
    assert client.hgetall(config.keys.checkpoint) == {}
    assert manager.wait() == []  # reported once

    manager.save(3, 30, model, optimizer, ["5-0", "6-0"])
    assert [f.checkpoint.covered_entry_ids for f in manager.wait()] == [{"fast_llm_consumer_0": ["5-0", "6-0"]}]
    assert [p.name for p in committed_checkpoints(manager.root)] == ["step-00000003"]
    assert not step_dir(manager.root, 2).exists()  # the uncommitted directory is pruned
    manager.close()


def test_a_failed_commit_hook_is_raised_after_the_commit(redis_server, tmp_path, world_of_one):
    """on_commit (the trainer's acks) failing on an unreachable Redis fails the save; the commit file is already
    durable, so the next start acks its entries (acknowledge_covered)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from portutil import free_port
    from rljob_trainer.progress_report import publish_checkpointed

    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    where = init_distributed(config)
    gone = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    manager = CheckpointManager(config, where,
                                on_commit=lambda committed: publish_checkpointed(gone, config, committed.documents_seen))
    model, optimizer = model_and_optimizer(config)
    manager.save(4, 40, model, optimizer, ["7-0"])
    with pytest.raises(CheckpointSaveFailed, match="checkpoint of step 4") as failed:
        manager.wait()
    assert isinstance(failed.value.__cause__, redis.ConnectionError)
    assert CommittedCheckpoint.read(step_dir(manager.root, 4)).covered_entry_ids == {"fast_llm_consumer_0": ["7-0"]}
    manager.close()
