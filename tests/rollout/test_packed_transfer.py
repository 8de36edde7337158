"""The packed weight-transfer layout across real processes over gloo, with real Redis membership: negotiated from
what each receiver announces, bit-identical to the per-tensor layout, and as safe when a receiver dies mid-update."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import PrefixStore

from rollout_harness import SMALL, make_config, tiny_model, wait_until
from test_rollout_weights import JOIN_S, TRANSFER_S, _live_ranks, _next_update, _receiver, _stop, _tickets
from rljob_rollout.backends.base import UpdateOutcome
from rljob_rollout.backends.cpu import CpuBackend
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_trainer.weight_publisher import WeightPublisher, publish_weights
from rljob_wire.packed import OWN_BUCKET_SHARE, plan
from rljob_wire.transfer import LAYOUT_KEY, STORE_PREFIX, StoreAddress, connect_store
from source_tree import REPO

MODEL = {**SMALL, "intermediateSize": 128}
"""The tiny model of these tests: width 16, so matrices of 896 (the embedding) to 8192 bytes (the MLP's, float32)."""
BUCKET = 4096
"""Bytes per bucket in these tests: :data:`MODEL`'s MLP weights go alone, its other matrices fill buckets of their own
(at least ``BUCKET // OWN_BUCKET_SHARE`` = 128 bytes) and its norms (64 bytes) share one."""


def _job(redis_server, tmp_path: Path, **publisher_options):
    """A job's config (also written to ``tmp_path/config.json`` for the receivers), a client and a publisher that
    packs in buckets of :data:`BUCKET`."""
    config = make_config(redis_server, tiny=MODEL)
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=JOIN_S, transfer_timeout_s=TRANSFER_S,
                                bucket_bytes=BUCKET, **publisher_options)
    return config, path, client, publisher


def _layout(config, ticket) -> str:
    store = connect_store(StoreAddress("127.0.0.1", config.weights_port), 10)
    return PrefixStore(f"{STORE_PREFIX}{ticket.id}/", store).get(LAYOUT_KEY).decode()


def _layouts(out: Path, replica: int) -> dict[int, str]:
    path = out / f"{replica}.layouts"
    lines = path.read_text().split() if path.exists() else []
    return {int(v): layout for v, layout in zip(lines[::2], lines[1::2])}


def _received(out: Path, replica: int, version: int) -> dict[str, torch.Tensor]:
    path = out / f"{replica}-{version}.pt"
    wait_until(path.exists, 15, f"receiver {replica} saving update {version}")
    return torch.load(path)


def _publish(publisher: WeightPublisher, model: torch.nn.Module, version: int, dtype=None) -> int:
    return publish_weights(model, publisher, step=version // 10, documents_seen=version, dtype=dtype).receivers


def test_packed_only_when_every_receiver_reads_it_and_bit_identical_to_per_tensor(redis_server, tmp_path):
    config, path, client, publisher = _job(redis_server, tmp_path, serve_late_joiners=False)
    model = tiny_model(config, seed=1)
    manifest = plan([(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()], BUCKET)
    assert BUCKET // OWN_BUCKET_SHARE == 128
    buckets = range(len(manifest.bucket_sizes))
    assert any(manifest.alone(b) for b in buckets)  # larger than a bucket
    assert any(manifest.sole(b) and not manifest.alone(b) for b in buckets)  # its own bucket, sent from its memory
    assert any(len(manifest.in_bucket(b)) > 1 for b in buckets)  # shared
    receivers = [_receiver(path, 0, tmp_path, redis_server.password, kept_buffers=True),
                 _receiver(path, 1, tmp_path, redis_server.password, per_tensor_only=True)]
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        # An older receiver among the members: the update goes per-tensor, to both.
        assert _publish(publisher, model, 10) == 2 and publisher.last_layout == "per-tensor"
        per_tensor = [_received(tmp_path, r, 10) for r in (0, 1)]
        receivers[1].kill()
        receivers[1].wait(10)
        client.hdel(config.keys.members, "2")  # gone: no longer invited
        # Only receivers that read packed: packed, float32 and then cast to bfloat16 on the way.
        assert _publish(publisher, model, 20) == 1 and publisher.last_layout == "packed"
        assert publisher.last_manifest is not None and publisher.last_manifest.bucket_sizes == manifest.bucket_sizes
        assert _publish(publisher, model, 30, dtype=torch.bfloat16) == 1 and publisher.last_layout == "packed"
        # A cast copies anyway: no bucket of its own, only tensors larger than a bucket leave the shared ones.
        assert publisher.last_manifest == plan([(n, tuple(t.shape), torch.bfloat16) for n, t in model.state_dict().items()],
                                               BUCKET, own_bytes=BUCKET + 1)
        # From a GPU neither (a copy runs at memory speed there; fewer NCCL broadcasts win). No GPU needed to plan.
        float32 = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
        assert publisher._manifest(float32, None, device=torch.device("cuda", 0)) == plan(float32, BUCKET, BUCKET + 1)
        assert publisher._manifest(float32, None) == manifest
        packed, packed_bf16 = _received(tmp_path, 0, 20), _received(tmp_path, 0, 30)
        tickets = _tickets(client, config)
        assert [(t.members, t.layout, _layout(config, t)) for t in tickets] == [
            ((1, 2), "per-tensor", "per-tensor"), ((1,), "packed", "packed"), ((1,), "packed", "packed")]
        assert _layouts(tmp_path, 0) == {10: "per-tensor", 20: "packed", 30: "packed"}
        assert _layouts(tmp_path, 1) == {10: "per-tensor"}
        expected = model.state_dict()
        for name, tensor in expected.items():
            for received in (*per_tensor, packed):
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
            assert packed_bf16[name].dtype == torch.bfloat16 and torch.equal(packed_bf16[name], tensor.bfloat16()), name
        assert list(packed) == list(expected)  # in the order sent
    finally:
        _stop(receivers)
        publisher.close()


def test_a_receiver_killed_mid_packed_update_holds_rank_0_no_longer_than_the_transfer_timeout(redis_server, tmp_path):
    config, path, client, publisher = _job(redis_server, tmp_path, poll_interval_s=0.5)
    receivers = [_receiver(path, 0, tmp_path, redis_server.password),
                 _receiver(path, 1, tmp_path, redis_server.password, die_after=2)]
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        assert _publish(publisher, tiny_model(config, seed=1), 10) == 2 and publisher.last_layout == "packed"
        second = tiny_model(config, seed=2)
        started = time.monotonic()
        received = _publish(publisher, second, 20)
        elapsed = time.monotonic() - started
        assert receivers[1].wait(10) == 17  # died after 2 tensors of update 20, in its first bucket
        assert received < 2 and elapsed < JOIN_S + 2 * TRANSFER_S, (received, elapsed)
        # The survivor's update failed with the group; the late-joiner service sends version 20 again, packed.
        survivor = _received(tmp_path, 0, 20)
        assert all(torch.equal(survivor[n], t) for n, t in second.state_dict().items())
        assert _layouts(tmp_path, 0)[20] == "packed"
    finally:
        _stop(receivers)
        publisher.close()


def test_a_receiver_sigkilled_from_outside_after_the_final_record_holds_rank_0_no_longer_than_the_transfer_timeout(
        redis_server, tmp_path):
    """Faults from outside only: receiver 0 is stopped (SIGSTOP) before the update so that the group cannot form
    before receiver 1 has joined; once receiver 1's ready record is in the store it is stopped too and receiver 0
    continued; once the publisher has written ``final`` (the group's members), receiver 1 is SIGKILLed with the
    packed update in flight."""
    config, path, client, publisher = _job(redis_server, tmp_path, poll_interval_s=0.5)
    receivers = [_receiver(path, 0, tmp_path, redis_server.password),
                 _receiver(path, 1, tmp_path, redis_server.password)]
    store = connect_store(StoreAddress("127.0.0.1", config.weights_port), 10)
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        assert _publish(publisher, tiny_model(config, seed=1), 10) == 2 and publisher.last_layout == "packed"
        _received(tmp_path, 0, 10), _received(tmp_path, 1, 10)
        second = tiny_model(config, seed=2)
        os.kill(receivers[0].pid, signal.SIGSTOP)
        outcome: dict[str, float] = {}

        def publish() -> None:
            started = time.monotonic()
            outcome["received"] = _publish(publisher, second, 20)
            outcome["elapsed"] = time.monotonic() - started

        thread = threading.Thread(target=publish)
        thread.start()
        wait_until(lambda: len(_tickets(client, config)) == 2, 10, "the update announced")
        scoped = PrefixStore(f"{STORE_PREFIX}{_tickets(client, config)[-1].id}/", store)
        wait_until(lambda: scoped.check(["ready/2"]), JOIN_S, "receiver 1 joined")
        os.kill(receivers[1].pid, signal.SIGSTOP)
        os.kill(receivers[0].pid, signal.SIGCONT)
        wait_until(lambda: scoped.check(["final"]), JOIN_S + 5, "the publisher's final record")
        assert json.loads(scoped.get("final")) == [1, 2]
        os.kill(receivers[1].pid, signal.SIGKILL)
        thread.join(JOIN_S + 2 * TRANSFER_S + 10)
        assert not thread.is_alive() and receivers[1].wait(10) == -signal.SIGKILL
        assert outcome["received"] < 2 and outcome["elapsed"] < JOIN_S + 2 * TRANSFER_S, outcome
        assert not (tmp_path / "1-20.pt").exists()
        # The survivor's update failed with the group; the late-joiner service sends version 20 again, packed.
        survivor = _received(tmp_path, 0, 20)
        assert all(torch.equal(survivor[n], t) for n, t in second.state_dict().items())
        assert _layouts(tmp_path, 0)[20] == "packed"
    finally:
        for process in receivers:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
        _stop(receivers)
        publisher.close()


def test_the_cpu_backend_unpacks_every_update_into_the_same_buffers(redis_server):
    """Two float32 updates into the same buffers (the backend keeps every bucket and reads the tensors in place), then
    one cast to bf16 on the way: into the buckets, or (the MLP's weights, larger than a bucket) into the late-joiner
    copy and sent from there; that copy holds the published bytes in the model's order once the publisher has
    settled."""
    config = make_config(redis_server, tiny=MODEL)
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=JOIN_S, transfer_timeout_s=TRANSFER_S,
                                poll_interval_s=3600, bucket_bytes=BUCKET)
    backend = CpuBackend(tiny_model(config, seed=0), pad_token_id=0, eos_token_id=None)
    subscriber = WeightSubscriber(config, client, replica_index=0)
    subscriber.follow_from_now()
    subscriber.heartbeat()
    pointers = []
    try:
        for version, seed, dtype in ((10, 1, None), (20, 2, None), (30, 3, torch.bfloat16)):
            model = tiny_model(config, seed=seed)
            publisher.bucket_bytes = BUCKET if dtype is None else BUCKET // 2  # bf16: the MLP's weights go alone
            sending = threading.Thread(target=_publish, args=(publisher, model, version, dtype))
            sending.start()
            event = _next_update(subscriber, version)
            assert event.ticket.layout == "packed"
            assert backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks) == UpdateOutcome.LOADED
            sending.join(30)
            expected = {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t
                        for n, t in model.state_dict().items()}
            for name, tensor in expected.items():
                assert torch.equal(backend.model.state_dict()[name], tensor.to(backend.model.state_dict()[name].dtype))
            copy = publisher.late_joiner_copy.items()
            assert [n for n, _ in copy] == list(expected)
            assert all(t.dtype == expected[n].dtype and torch.equal(t, expected[n]) for n, t in copy)
            buckets = backend.buckets
            pointers.append(([buckets.get(b, 1, torch.device("cpu")).data_ptr() for b in range(len(buckets))],
                             buckets.nbytes))
    finally:
        publisher.close()
    model_bytes = sum(t.numel() * t.element_size() for t in backend.model.state_dict().values())
    assert pointers[0] == pointers[1] and 0 < pointers[0][1] <= model_bytes  # the buckets read in place, kept


PREVIOUS_RELEASE = "bcac57ca8b94bd0ace791e37a78c185319d7e859"
"""The last commit before the packed layout (f00252c added it): its receivers announce no layout."""


def _previous_receiver(tree: Path, config_path: Path, replica: int, out: Path, password: str) -> subprocess.Popen:
    """transfer_receiver.py of :data:`PREVIOUS_RELEASE`, on that commit's own api, wire and rollout packages only."""
    env = dict(os.environ, REDIS_PASSWORD=password, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(str(tree / folder) for folder in ("api", "wire", "rollout")))
    script = tree / "tests" / "rollout" / "transfer_receiver.py"
    return subprocess.Popen([sys.executable, str(script), str(config_path), str(replica), str(out)], env=env, cwd=tree,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory) -> Path:
    """The previous release's receiving code, from ``git archive`` of this repository."""
    tree = tmp_path_factory.mktemp("previous")
    paths = ["api", "wire", "rollout", "tests/rollout/transfer_receiver.py"]
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, *paths], check=True,
                             capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(tree, filter="data")
    return tree


def test_a_receiver_of_the_previous_release_gets_per_tensor_updates(redis_server, tmp_path, previous_tree):
    """An upgrade mid-run: the trainer is this version, a running rollout process the previous one. Every update it
    is a member of goes per-tensor and arrives whole; once it has left, updates go packed again."""
    config, path, client, publisher = _job(redis_server, tmp_path, serve_late_joiners=False)
    model = tiny_model(config, seed=3)
    receivers = [_previous_receiver(previous_tree, path, 0, tmp_path, redis_server.password),
                 _receiver(path, 1, tmp_path, redis_server.password)]
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        assert publisher.live_members()[1].layouts == ()
        assert _publish(publisher, model, 10) == 2 and publisher.last_layout == "per-tensor"
        assert _publish(publisher, model, 20, dtype=torch.bfloat16) == 2 and publisher.last_layout == "per-tensor"
        expected = model.state_dict()
        for version, cast in ((10, lambda t: t), (20, lambda t: t.bfloat16() if t.is_floating_point() else t)):
            for replica in (0, 1):
                received = _received(tmp_path, replica, version)
                assert list(received) == list(expected)
                for name, tensor in expected.items():
                    assert torch.equal(received[name], cast(tensor)) and received[name].dtype == cast(tensor).dtype
        _stop(receivers[:1])
        client.hdel(config.keys.members, "1")  # gone: no longer invited
        assert _publish(publisher, model, 30) == 1 and publisher.last_layout == "packed"
        assert all(torch.equal(t, expected[n]) for n, t in _received(tmp_path, 1, 30).items())  # saved after its layout
        assert _layouts(tmp_path, 1) == {10: "per-tensor", 20: "per-tensor", 30: "packed"}
        assert not (tmp_path / "0.layouts").exists()  # the previous receiver knows no layouts
    finally:
        _stop(receivers)
        publisher.close()
