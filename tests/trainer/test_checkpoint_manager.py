"""CheckpointManager in one process (a world of one over gloo): save/commit/prune, load, export, initFrom,
and the resume-time ack of covered entries against a real Redis."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rljob_trainer.checkpoint import (
    COMMIT_FILE,
    CheckpointManager,
    CommittedCheckpoint,
    acknowledge_covered,
    committed_checkpoints,
    resolve_init_from,
    step_dir,
)
from rljob_trainer.model import DigitTokenizer, build_model
from rljob_trainer.parallel import init_distributed, shutdown_distributed
from train_harness import make_config, make_documents, write_documents

torch.set_num_threads(1)


@pytest.fixture()
def world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    shutdown_distributed()


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
        committed = manager.save(step, step * 10, model, optimizer, [f"{step}-0", f"{step}-1"])
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
    CheckpointManager(source_config, where).save(5, 50, model, optimizer, ["9-0"])

    config = make_config(redis_server, tmp_path / "ckpt", processes=1, init_from=str(tmp_path / "other-job"))
    manager = CheckpointManager(config, where)
    assert manager.resume_source() == (step_dir(tmp_path / "other-job", 5), False)
    manager.save(6, 60, model, optimizer, [])
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
