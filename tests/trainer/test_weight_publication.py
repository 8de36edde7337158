"""The trainer's weight publication (:func:`rljob_trainer.weight_publisher.publish_weights`) from DDP-style plain tensors and
from FSDP2 shards: real gloo process groups, a real Redis, a real rollout member receiving over the wire."""

from __future__ import annotations

import json
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist

from rljob_api.config import JobConfig
from rljob_wire.model import DigitTokenizer, build_model
from rljob_trainer.parallel import Distributed, ParallelDims, wrap_model
from rljob_wire.connection import connect
from rljob_trainer.weight_publisher import WeightPublisher, publish_weights
from train_harness import WeightReceiver, init_gloo, make_config, run_ranks, wait_until

SEED = 7
DTYPES = {"": None, "bfloat16": torch.bfloat16}


def _expected(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """The model's state dict as a publication in ``dtype`` sends it (floating-point tensors cast)."""
    return {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t
            for name, t in model.state_dict().items()}


def _fsdp_rank(rank: int, world_size: int, tmp_dir: str, config_json: str, dtype_name: str, password: str) -> None:
    """One rank of a 2-rank FSDP2 trainer, sharded as the trainer shards (:func:`wrap_model`, strategy fsdp), that
    publishes once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world_size, tmp_dir)
    config = JobConfig.model_validate_json(config_json)
    assert config.spec.trainer.parallelism.strategy == "fsdp"
    dims = ParallelDims.from_config(config, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    where = Distributed(rank, world_size, rank, torch.device("cpu"), "gloo", dims, mesh)
    model = wrap_model(build_model(config.spec.model, DigitTokenizer().vocab_size, seed=SEED), where,
                       config.spec.trainer).model
    assert all(isinstance(p, DTensor) for p in model.parameters())
    publisher = None
    if rank == 0:
        client = connect(config, password=password)
        publisher = WeightPublisher(config, client, serve_late_joiners=True, poll_interval_s=3600)
        wait_until(lambda: 1 in publisher.live_members(), 30, "the rollout member heartbeating")
    dist.barrier()
    publication = publish_weights(model, publisher, step=1, documents_seen=10, dtype=DTYPES[dtype_name])
    copy = None if publisher is None else {n: str(t.dtype) for n, t in publisher.late_joiner_copy.items()}
    Path(tmp_dir, f"publication-{rank}.json").write_text(json.dumps(
        {"receivers": publication.receivers, "gather_ms": publication.gather_ms, "copy_dtypes": copy}))
    if publisher is not None:
        publisher.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype_name", ["", "bfloat16"])
def test_fsdp_ranks_send_the_rollout_what_a_ddp_rank_sends(redis_server, tmp_path, dtype_name):
    dtype = DTYPES[dtype_name]
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, parallelism={"strategy": "fsdp"})
    client = redis_server.client()
    receiver = WeightReceiver(config, client)
    publisher = None
    try:
        run_ranks(_fsdp_rank, 2, tmp_path, config.to_json(), dtype_name, redis_server.password)
        wait_until(lambda: 10 in receiver.received, 30, "the FSDP ranks' update at the rollout member")
        model = build_model(config.spec.model, DigitTokenizer().vocab_size, seed=SEED)  # the same weights, plain
        publisher = WeightPublisher(config, client, poll_interval_s=3600)
        ddp = publish_weights(model, publisher, step=2, documents_seen=20, dtype=dtype)
        wait_until(lambda: 20 in receiver.received, 30, "the DDP rank's update at the rollout member")
        ddp_copy = {name: t.clone() for name, t in publisher.late_joiner_copy.items()}
        ddp_copy_bytes = publisher.late_joiner_copy.nbytes
    finally:
        receiver.stop()
        if publisher is not None:
            publisher.close()
    assert receiver.error is None, receiver.error
    from_fsdp, from_ddp = receiver.received[10], receiver.received[20]
    expected = _expected(model, dtype)
    assert list(from_fsdp) == list(from_ddp) == list(expected)  # the same names in the same order
    for name, tensor in expected.items():
        assert from_fsdp[name].dtype == from_ddp[name].dtype == tensor.dtype, name
        assert from_fsdp[name].shape == tensor.shape and torch.equal(from_fsdp[name], from_ddp[name]), name
        assert torch.equal(from_ddp[name], tensor), name
    ranks = [json.loads((tmp_path / f"publication-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["receivers"] == 1 and ranks[1]["receivers"] is None and ddp.receivers == 1
    assert all(r["gather_ms"] > 0 for r in ranks) and ddp.gather_ms == 0  # both ranks gathered, DDP did not
    assert ranks[0]["copy_dtypes"] == {name: str(t.dtype) for name, t in expected.items()}  # in the published dtype
    # The DDP rank's late-joiner copy: the published tensors, in the published dtype (bf16: 2 bytes per parameter).
    assert list(ddp_copy) == list(expected)
    for name, tensor in expected.items():
        assert ddp_copy[name].dtype == tensor.dtype and torch.equal(ddp_copy[name], tensor), name
    parameters = sum(t.numel() for t in expected.values())
    assert all(t.is_floating_point() for t in expected.values())
    assert ddp_copy_bytes == parameters * (2 if dtype == torch.bfloat16 else 4), (ddp_copy_bytes, parameters)


def _made_tensors(seed: int, alive_at_next: list[bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """Six fresh [300, 100] float32 tensors (what a gather makes); before making each one after the first, records
    whether the previous one's memory is still referenced anywhere."""
    previous: Optional[weakref.ref] = None
    for i in range(6):
        if previous is not None:
            alive_at_next.append(previous() is not None)
        tensor = torch.full((300, 100), seed + i + 0.123456789, dtype=torch.float32)
        previous = weakref.ref(tensor.untyped_storage())
        yield f"model.layers.{i}.weight", tensor
        del tensor


def test_transient_tensors_are_dropped_one_by_one_and_the_copy_is_reused_in_the_published_dtype(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    receiver = WeightReceiver(config, client)
    publisher = WeightPublisher(config, client, join_timeout_s=10, poll_interval_s=3600)
    alive_at_next: list[bool] = []
    pointers = []
    try:
        wait_until(lambda: 1 in publisher.live_members(), 30, "the rollout member heartbeating")
        for version, seed in ((10, 0.0), (20, 100.0)):
            sent = publisher.publish(_made_tensors(seed, alive_at_next), step=version // 10, documents_seen=version,
                                     dtype=torch.bfloat16, transient=True)
            assert sent == 1
            wait_until(lambda v=version: v in receiver.received, 30, f"update {version} at the rollout member")
            copy = publisher.late_joiner_copy.items()
            assert [name for name, _ in copy] == [f"model.layers.{i}.weight" for i in range(6)]
            for i, (name, tensor) in enumerate(copy):
                expected = torch.full((300, 100), seed + i + 0.123456789).to(torch.bfloat16)
                assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected), name
                assert torch.equal(receiver.received[version][name], expected), name
            pointers.append([tensor.data_ptr() for _, tensor in copy])
        assert publisher.late_joiner_copy.nbytes == 6 * 300 * 100 * 2  # one copy, 2 bytes per parameter
    finally:
        receiver.stop()
        publisher.close()
    assert alive_at_next == [False] * 10  # each made tensor was freed before the next one was made
    assert pointers[0] == pointers[1]  # the second publication overwrote the first one's buffers


def test_the_models_own_tensors_are_copied_after_the_broadcast_and_settle_waits_for_it(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    receiver = WeightReceiver(config, client)
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, seed=SEED)
    publisher = WeightPublisher(config, client, join_timeout_s=10, poll_interval_s=3600)
    try:
        wait_until(lambda: 1 in publisher.live_members(), 30, "the rollout member heartbeating")
        pointers = []
        for version in (10, 20):
            publication = publish_weights(model, publisher, step=version // 10, documents_seen=version)
            assert publication.receivers == 1 and publication.gather_ms == 0 and publication.duration_ms > 0
            phases = publication.phases_ms
            assert list(phases) == ["announce", "join", "group", "tensors", "end"] and min(phases.values()) >= 0, phases
            assert sum(phases.values()) <= publication.duration_ms, (phases, publication.duration_ms)
            publisher.settle()  # what the trainer does before its optimizer step
            expected = {name: t.clone() for name, t in model.state_dict().items()}
            copy = dict(publisher.late_joiner_copy.items())
            wait_until(lambda v=version: v in receiver.received, 30, f"update {version} at the rollout member")
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(-2.0)  # the next "optimizer step": the copy must not follow
            for name, tensor in expected.items():
                assert torch.equal(copy[name], tensor) and torch.equal(receiver.received[version][name], tensor), name
                assert copy[name].data_ptr() != model.state_dict()[name].data_ptr(), name
            pointers.append([t.data_ptr() for t in copy.values()])
        assert pointers[0] == pointers[1]
    finally:
        receiver.stop()
        publisher.close()


@pytest.mark.parametrize("megabytes, bucket_bytes", [(None, 64 << 20), (1, 1 << 20)])
def test_the_trainer_packs_in_buckets_of_spec_trainer_weight_sync_bucket_megabytes(
        redis_server, tmp_path, monkeypatch, megabytes, bucket_bytes):
    """The trainer's start-of-attempt publication to a packed receiver uses ``trainer.weightSyncBucketMegabytes``
    (unset: 64 MiB) and delivers the model bit for bit."""
    from rljob_trainer.parallel import init_distributed, shutdown_distributed
    from rljob_trainer.trainer import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, parallelism={"strategy": "ddp"})
    config.spec.trainer.weight_sync_bucket_megabytes = megabytes
    client = redis_server.client()
    receiver = WeightReceiver(config, client)
    trainer = None
    where = init_distributed(config)
    try:
        wait_until(lambda: client.hlen(config.keys.members) == 1, 30, "the rollout member heartbeating")
        trainer = Trainer(config, where, client)
        trainer.resume()
        publisher = trainer.publisher
        assert publisher is not None and publisher.last_layout == "packed"
        assert publisher.last_manifest is not None and publisher.last_manifest.bucket_bytes == bucket_bytes
        wait_until(lambda: 0 in receiver.received, 30, "the start's update at the rollout member")
        for name, value in trainer.model.state_dict().items():
            assert torch.equal(receiver.received[0][name.removeprefix("module.")], value), name
    finally:
        receiver.stop()
        if trainer is not None:
            trainer.close()
        shutdown_distributed()


def test_a_publication_in_the_background_sends_its_weights_and_settle_raises_what_it_raised(
        redis_server, tmp_path, monkeypatch):
    """What the trainer does for an unsharded model on CPU (``Trainer.overlaps_publication``): the step's publication
    runs on the publisher's thread and ``settle`` (before the next optimizer step) waits for it; a publication fenced
    by a later gang attempt raises ``Fenced`` there, and sends nothing."""
    from rljob_trainer import fence

    monkeypatch.setenv("RLJOB_ATTEMPT", "3")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)
    client = redis_server.client()
    fence.claim(client, config.keys)  # attempt 3 owns the job
    receiver = WeightReceiver(config, client)
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, seed=SEED)
    publisher = WeightPublisher(config, client, join_timeout_s=10, poll_interval_s=3600)
    try:
        wait_until(lambda: 1 in publisher.live_members(), 30, "the rollout member heartbeating")
        expected = {name: t.clone() for name, t in model.state_dict().items()}
        release = threading.Event()

        def held() -> Iterator[tuple[str, torch.Tensor]]:  # the second tensor waits for the test
            for index, pair in enumerate(model.state_dict().items()):
                if index == 1:
                    assert release.wait(30)
                yield pair

        tensors = [(name, tuple(t.shape), t.dtype) for name, t in expected.items()]
        held_back = publisher.in_background(lambda: publisher.publish(held(), step=0, documents_seen=5, tensors=tensors))
        time.sleep(0.5)
        assert not held_back.done()  # it runs on the publisher's thread; the caller went on
        release.set()
        publisher.settle()
        assert held_back.done() and held_back.result() == 1
        started = publisher.in_background(lambda: publish_weights(model, publisher, step=1, documents_seen=10))
        publisher.settle()
        assert started.done()
        publication = started.result()
        assert (publication.receivers, publication.layout) == (1, "packed") and publication.duration_ms > 0
        wait_until(lambda: 10 in receiver.received, 30, "update 10 at the rollout member")
        assert sorted(receiver.received) == [5, 10]
        copy = dict(publisher.late_joiner_copy.items())
        for name, tensor in expected.items():
            assert torch.equal(receiver.received[10][name], tensor) and torch.equal(copy[name], tensor), name

        fence.claim(client, config.keys, attempt=4)  # a later attempt takes the job over
        fenced = publisher.in_background(lambda: publish_weights(model, publisher, step=2, documents_seen=20))
        with pytest.raises(fence.Fenced, match="attempt 4 owns the job"):
            publisher.settle()
        assert isinstance(fenced.exception(), fence.Fenced)
        publisher.settle()  # raised once: the next step's settle waits for nothing
        assert 20 not in receiver.received and [e["documents_seen"] for e in _ready_events(client, config)] == [5, 10]
    finally:
        receiver.stop()
        publisher.close()


def _ready_events(client, config: JobConfig) -> list[dict]:
    return [e for e in (json.loads(f[b"event"]) for _, f in client.xrange(config.keys.events))
            if e["type"] == "weights_ready"]
