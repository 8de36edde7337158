"""The weight transfer (DESIGN §2, §3) across real processes over gloo, with real Redis membership."""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from source_tree import pythonpath
from pathlib import Path

import pytest
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from portutil import free_port
from rollout_harness import make_config, tiny_model, wait_until
from rljob_api import protocol
from rljob_api.protocol import TransferTicket, parse_event, parse_member
from rljob_rollout.backends.base import UpdateOutcome
from rljob_rollout.backends.cpu import CpuBackend
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_wire.transfer import (GROUP_KEY, STORE_PREFIX, GroupKeeper, KeptGroup, StoreAddress, TransferFailed, UpdateSender,
                                    _AllowListUnpickler, _reported_group, connect_store, receive_update, send_update,
                                    unwrapped_name)
from rljob_trainer.weight_publisher import WeightPublisher
from rljob_wire import transfer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JOIN_S, TRANSFER_S = 3.0, 8.0


def _receiver(config_path: Path, replica: int, out: Path, password: str, die_after: int | None = None,
              fresh_groups: bool = False, per_tensor_only: bool = False, kept_buffers: bool = False) -> subprocess.Popen:
    """A receiver process (transfer_receiver.py) as transfer rank 1 + ``replica``."""
    env = dict(os.environ, REDIS_PASSWORD=password, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = pythonpath(env)
    args = [sys.executable, str(HERE / "transfer_receiver.py"), str(config_path), str(replica), str(out)]
    if die_after is not None:
        args += ["--die-after", str(die_after)]
    if fresh_groups:
        args.append("--fresh-groups")
    if per_tensor_only:
        args.append("--per-tensor-only")
    if kept_buffers:
        args.append("--kept-buffers")
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _assert_same(received_path: Path, model: torch.nn.Module) -> None:
    received = torch.load(received_path)
    expected = model.state_dict()
    assert sorted(received) == sorted(expected)
    for name, tensor in expected.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


@pytest.fixture()
def setup(redis_server, tmp_path):
    config = make_config(redis_server)
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=JOIN_S, transfer_timeout_s=TRANSFER_S, poll_interval_s=0.5)
    yield config, path, client, publisher
    publisher.close()


def _live_ranks(publisher: WeightPublisher, ranks: set[int]) -> bool:
    return ranks <= set(publisher.live_members())


def _tickets(client, config) -> list[TransferTicket]:
    """The tickets of every weights_ready event so far, in order."""
    events = [parse_event(i.decode(), f) for i, f in client.xrange(config.keys.events)]
    return [e.ticket for e in events if e.type == protocol.EVENT_WEIGHTS_READY]


def _group_of(config, ticket: TransferTicket) -> str:
    """The group an update went over, as the publisher wrote it in the store (the id of the update that formed it)."""
    store = connect_store(StoreAddress("127.0.0.1", config.weights_port), 10)
    return PrefixStore(f"{STORE_PREFIX}{ticket.id}/", store).get(GROUP_KEY).decode()


def test_two_receiver_processes_get_equal_tensors_and_a_dead_one_costs_one_join_timeout(setup, redis_server, tmp_path):
    config, path, client, publisher = setup
    receivers = [_receiver(path, i, tmp_path, redis_server.password) for i in range(2)]
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        first = tiny_model(config, seed=1)
        assert publisher.publish(first.named_parameters(), step=1, documents_seen=10) == 2
        for replica in range(2):
            wait_until(lambda r=replica: (tmp_path / f"{r}-10.pt").exists(), 10, f"receiver {replica} saving update 10")
            _assert_same(tmp_path / f"{replica}-10.pt", first)

        receivers[1].kill()  # its heartbeat stays fresh for MEMBER_TTL_S: it is still invited
        receivers[1].wait(10)
        second = tiny_model(config, seed=2)
        started = time.monotonic()
        assert publisher.publish(second.named_parameters(), step=2, documents_seen=20) == 1
        elapsed = time.monotonic() - started
        assert elapsed < 2 * JOIN_S + TRANSFER_S, f"publish with a dead member took {elapsed:.1f} s"
        wait_until(lambda: (tmp_path / "0-20.pt").exists(), 10, "the live receiver saving update 20")
        _assert_same(tmp_path / "0-20.pt", second)
        assert not (tmp_path / "1-20.pt").exists()

        events = [parse_event(i.decode(), f) for i, f in client.xrange(config.keys.events)]
        ready = [e for e in events if e.type == protocol.EVENT_WEIGHTS_READY]
        assert [(e.step, e.documents_seen) for e in ready][:2] == [(1, 10), (2, 20)]
        assert ready[1].ticket.members == (1, 2)
        assert _group_of(config, ready[1].ticket) == ready[1].ticket.id  # one member left: a new group

        publisher.finish(step=2, documents_seen=20)
        assert receivers[0].wait(30) == 0
    finally:
        _stop(receivers)


def test_receiver_dying_mid_transfer_does_not_hang_and_the_survivor_is_served_again(setup, redis_server, tmp_path):
    config, path, client, publisher = setup
    receivers = [_receiver(path, 0, tmp_path, redis_server.password),
                 _receiver(path, 1, tmp_path, redis_server.password, die_after=3)]
    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        assert publisher.publish(tiny_model(config, seed=1).named_parameters(), step=1, documents_seen=10) == 2
        wait_until(lambda: (tmp_path / "0-10.pt").exists() and (tmp_path / "1-10.pt").exists(), 10, "update 10 saved")

        second = tiny_model(config, seed=2)
        started = time.monotonic()
        received = publisher.publish(second.named_parameters(), step=2, documents_seen=20)
        elapsed = time.monotonic() - started
        assert receivers[1].wait(10) == 17  # died after 3 tensors of update 20
        assert received < 2 and elapsed < JOIN_S + 2 * TRANSFER_S, (received, elapsed)
        tickets = _tickets(client, config)
        assert _group_of(config, tickets[1]) == tickets[0].id  # it died on the group kept from update 10
        # The survivor's update failed with the group; the late-joiner service sends version 20 again.
        wait_until(lambda: (tmp_path / "0-20.pt").exists(), 3 * (JOIN_S + TRANSFER_S), "survivor re-served with version 20")
        _assert_same(tmp_path / "0-20.pt", second)
    finally:
        _stop(receivers)


def test_a_late_joiner_gets_the_last_published_weights(setup):
    config, _path, client, publisher = setup
    model = tiny_model(config, seed=4)
    assert publisher.publish(model.named_parameters(), step=3, documents_seen=30) == 0  # nobody there yet
    subscriber = WeightSubscriber(config, client, replica_index=0)
    subscriber.follow_from_now()
    subscriber.heartbeat()
    received: dict[str, torch.Tensor] = {}
    deadline = time.monotonic() + 20
    while not received and time.monotonic() < deadline:
        for event in subscriber.poll(block_ms=200):
            assert (event.step, event.documents_seen) == (3, 30)
            receive_update(subscriber.address, event.ticket, 1, device=torch.device("cpu"), sink=received.__setitem__)
    assert sorted(received) == sorted(model.state_dict())
    assert all(torch.equal(received[n], t) for n, t in model.state_dict().items())


def test_publish_consumes_every_tensor_once_without_members_and_strips_wrapper_prefixes(setup):
    _config, _path, _client, publisher = setup
    consumed = []

    def tensors():
        for i in range(3):
            consumed.append(i)
            yield f"module.layer{i}.weight", torch.full((2,), float(i))

    assert publisher.publish(tensors(), step=0, documents_seen=0) == 0
    assert consumed == [0, 1, 2]
    assert [name for name, _ in publisher.late_joiner_copy.items()] == ["layer0.weight", "layer1.weight", "layer2.weight"]
    assert unwrapped_name("module._orig_mod.model.x") == "model.x"


def _next_update(subscriber: WeightSubscriber, version: int, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in subscriber.poll(block_ms=200):
            if event.ticket is not None and event.documents_seen == version:
                return event
    raise AssertionError(f"no weights_ready for version {version} within {timeout_s} s")


def test_the_cpu_backend_receives_every_update_into_the_same_buffers(setup):
    config, _path, client, publisher = setup
    backend = CpuBackend(tiny_model(config, seed=0), pad_token_id=0, eos_token_id=None)
    subscriber = WeightSubscriber(config, client, replica_index=0)
    subscriber.follow_from_now()
    subscriber.heartbeat()
    pointers = []
    for version, seed in ((10, 1), (20, 2)):
        model = tiny_model(config, seed=seed)
        sending = threading.Thread(target=publisher.publish, args=(model.state_dict().items(),),
                                   kwargs={"step": version // 10, "documents_seen": version})
        sending.start()
        event = _next_update(subscriber, version)
        assert backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks) == UpdateOutcome.LOADED
        sending.join(30)
        for name, tensor in model.state_dict().items():
            assert torch.equal(backend.model.state_dict()[name], tensor), name
        pointers.append({name: t.data_ptr() for name, t in backend.staging.items()})
    assert pointers[0] == pointers[1] and sorted(pointers[0]) == sorted(model.state_dict())
    first, second = _tickets(client, config)[:2]
    assert _group_of(config, second) == first.id and backend.groups.kept_id("gloo") == first.id  # the group was kept
    assert backend.staging.nbytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_a_publication_takes_over_from_a_late_joiner_update_waiting_for_its_member(setup):
    config, _path, client, publisher = setup
    model = tiny_model(config, seed=3)
    assert publisher.publish(model.state_dict().items(), step=1, documents_seen=10) == 0  # nobody there yet
    absent = WeightSubscriber(config, client, replica_index=0)  # heartbeats without weights, never joins
    absent.start_heartbeats(interval_s=0.5)
    try:
        # The late-joiner service invites it and waits up to JOIN_S for it to be ready ...
        wait_until(lambda: len(client.xrange(config.keys.events)) >= 2, 10, "a late-joiner update inviting the member")
        started = time.monotonic()
        assert publisher.publish(model.state_dict().items(), step=2, documents_seen=20) == 0
        elapsed = time.monotonic() - started
    finally:
        absent.leave()
    # ... but the publication does not wait for that: only for its own join (the member is invited again).
    assert JOIN_S <= elapsed < JOIN_S + 1.5, elapsed


def test_timeouts_must_stay_below_the_collective_timeout(redis_server):
    config = make_config(redis_server, trainer={"collectiveTimeoutSeconds": 20})
    with pytest.raises(ValueError, match="collectiveTimeoutSeconds = 20"):
        WeightPublisher(config, redis_server.client(), join_timeout_s=5, transfer_timeout_s=15, serve_late_joiners=False)


def test_events_members_and_tickets_parse_or_fail_clearly():
    ticket = TransferTicket("abc", (1, 3), "gloo", 2.0, 9.0)
    assert TransferTicket.from_json(json.loads(json.dumps(ticket.to_json()))) == ticket
    body = {"type": "weights_ready", "step": 4, "documents_seen": 512, "transfer": ticket.to_json()}
    event = parse_event("1-0", {b"event": json.dumps(body).encode()})
    assert (event.type, event.step, event.documents_seen, event.ticket) == ("weights_ready", 4, 512, ticket)
    upstream = parse_event("2-0", {b"event": b'{"type": "weights_ready", "step": 1, "documents_seen": 2}'})
    assert upstream.ticket is None
    bare = parse_event("3-0", {b"event": b'{"type": "training_finished"}'})  # an upstream or older trainer
    assert (bare.type, bare.step, bare.documents_seen) == ("training_finished", None, None)
    final = parse_event("3-1", {b"event": b'{"type": "training_finished", "step": 40, "documents_seen": 640}'})
    assert (final.type, final.step, final.documents_seen) == ("training_finished", 40, 640)
    odd = parse_event("3-2", {b"event": b'{"type": "training_finished", "step": "40", "documents_seen": true}'})
    assert (odd.step, odd.documents_seen) == (None, None)  # still ends training, like a bare one
    for bad in ({}, {b"event": b"nope"}, {b"event": b'{"type": "weights_ready", "step": "1", "documents_seen": 2}'}):
        with pytest.raises(ValueError):
            parse_event("4-0", bad)
    with pytest.raises(ValueError, match="transfer.backend"):
        TransferTicket.from_json({"id": "x", "members": [1], "backend": "mpi"})
    assert parse_member(b'{"time": 5.5, "version": 7, "instance": "ab"}').version == 7
    assert parse_member(b"12.5").time == 12.5
    with pytest.raises(ValueError):
        parse_member(b'{"version": 1}')


def test_metadata_unpickling_refuses_anything_but_the_allow_list():
    meta = ("weights", "model.x", torch.Size([2, 3]), torch.bfloat16)
    assert _AllowListUnpickler(io.BytesIO(pickle.dumps(meta))).load() == meta
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        _AllowListUnpickler(io.BytesIO(pickle.dumps(threading.Thread))).load()


def test_the_group_is_kept_while_the_members_stay_and_formed_anew_when_one_joins_or_leaves(redis_server, tmp_path):
    config = make_config(redis_server)
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=JOIN_S, transfer_timeout_s=TRANSFER_S, serve_late_joiners=False)
    receivers = [_receiver(path, i, tmp_path, redis_server.password) for i in range(2)]

    def publish(version: int, replicas: tuple[int, ...]) -> None:
        model = tiny_model(config, seed=version)
        assert publisher.publish(model.named_parameters(), step=version // 10, documents_seen=version) == len(replicas)
        for replica in replicas:
            wait_until(lambda r=replica: (tmp_path / f"{r}-{version}.pt").exists(), 10, f"receiver {replica} saving {version}")
            _assert_same(tmp_path / f"{replica}-{version}.pt", model)

    try:
        wait_until(lambda: _live_ranks(publisher, {1, 2}), 60, "both receivers heartbeating")
        publish(10, (0, 1))
        publish(20, (0, 1))
        receivers.append(_receiver(path, 2, tmp_path, redis_server.password))  # a member joins
        wait_until(lambda: _live_ranks(publisher, {1, 2, 3}), 60, "the third receiver heartbeating")
        publish(30, (0, 1, 2))
        publish(40, (0, 1, 2))
        receivers[2].kill()  # a member leaves; its heartbeat stays fresh for MEMBER_TTL_S: still invited, never ready
        receivers[2].wait(10)
        publish(50, (0, 1))
        publish(60, (0, 1))
        tickets = _tickets(client, config)
        assert [t.members for t in tickets] == [(1, 2), (1, 2), (1, 2, 3), (1, 2, 3), (1, 2, 3), (1, 2, 3)]
        ids = [t.id for t in tickets]
        # Formed by the first update, reused by the second; formed anew when rank 3 joined, and when it left.
        assert [_group_of(config, t) for t in tickets] == [ids[0], ids[0], ids[2], ids[2], ids[4], ids[4]]
    finally:
        _stop(receivers)
        publisher.close()


def test_a_receiver_that_stops_reading_holds_rank_0_no_longer_than_the_transfer_timeout_and_loses_its_group(redis_server):
    config = make_config(redis_server)
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=JOIN_S, transfer_timeout_s=2.0, serve_late_joiners=False)
    subscriber = WeightSubscriber(config, client, replica_index=0)
    subscriber.follow_from_now()
    subscriber.start_heartbeats(interval_s=0.5)
    groups = GroupKeeper()
    outcomes: list = []
    kept: list = []

    def receive(version: int, sink) -> None:
        event = _next_update(subscriber, version)
        try:
            outcomes.append(receive_update(subscriber.address, event.ticket, 1, device=torch.device("cpu"), sink=sink, groups=groups))
        except TransferFailed as error:
            outcomes.append(error)
        kept.append(groups.kept_id("gloo"))

    elapsed = {}
    try:
        for version, how in ((10, "reads"), (15, "late"), (20, "stalls"), (30, "reads")):
            sink = (lambda *_: time.sleep(6)) if how == "stalls" else (lambda *_: None)
            receiving = threading.Thread(target=receive, args=(version, sink), daemon=True)
            if how != "late":
                receiving.start()
            started = time.monotonic()
            sent = publisher.publish(tiny_model(config, seed=version).state_dict().items(), step=version // 10, documents_seen=version)
            elapsed[version] = (sent, time.monotonic() - started)
            if how == "late":  # ready only after the join timeout: left out of an update nobody joined
                receiving.start()
            receiving.join(30)
    finally:
        subscriber.leave()
        publisher.close()
    tickets = _tickets(client, config)
    assert [elapsed[v][0] for v in (10, 15, 30)] == [1, 0, 1], elapsed
    # The third update goes over the group kept from the first (the second, which nobody joined, changed nothing);
    # its deadline (2 s) ends it on rank 0, which drops the group ...
    assert elapsed[20][0] == 0 and 2.0 <= elapsed[20][1] < 3.5, elapsed
    assert outcomes[:2] == [True, False] and isinstance(outcomes[2], TransferFailed) and outcomes[3] is True, outcomes
    assert outcomes[2].tensors_loaded == 1  # the first tensor's sink stalled; the next broadcast failed
    # ... and so does the receiver: the fourth update forms a new one.
    assert kept == [tickets[0].id, tickets[0].id, None, tickets[3].id]
    assert [_group_of(config, tickets[i]) for i in (0, 2, 3)] == [tickets[0].id, tickets[0].id, tickets[3].id]


def _older_publisher_update(store: TCPStore, ticket: TransferTicket, tensors: list) -> None:
    """Rank 0 of an update as a publisher before kept groups sent it: no ``group`` key, a new group every time."""
    scoped = PrefixStore(f"{STORE_PREFIX}{ticket.id}/", store)
    scoped.wait([f"ready/{rank}" for rank in ticket.members])
    scoped.set("final", json.dumps(list(ticket.members)))
    group = ProcessGroupGloo(PrefixStore("pg/", scoped), 0, 1 + len(ticket.members), datetime.timedelta(seconds=10))
    sender = UpdateSender(KeptGroup(ticket.id, ticket.members, group), torch.device("cpu"), time.monotonic() + 10)
    for name, tensor in tensors:
        sender.send(name, tensor)
    sender.finish()


def test_older_receivers_and_an_older_publisher_get_a_new_group_for_every_update(setup, redis_server, tmp_path):
    config, path, client, publisher = setup
    older = _receiver(path, 0, tmp_path, redis_server.password, fresh_groups=True)  # reports no group
    try:
        wait_until(lambda: _live_ranks(publisher, {1}), 60, "the receiver heartbeating")
        for version in (10, 20):
            model = tiny_model(config, seed=version)
            assert publisher.publish(model.named_parameters(), step=version // 10, documents_seen=version) == 1
            wait_until(lambda v=version: (tmp_path / f"0-{v}.pt").exists(), 10, f"update {version} saved")
            _assert_same(tmp_path / f"0-{version}.pt", model)
        assert [_group_of(config, t) == t.id for t in _tickets(client, config)] == [True, True]
    finally:
        _stop([older])
    assert _reported_group(b"1") is None and _reported_group(b'{"group": null}') is None  # an older receiver's value
    assert _reported_group(b'{"group": "abc"}') == "abc"

    # A receiver that keeps groups, served by a publisher that writes no `group`: it forms each update's group.
    store = TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    address = StoreAddress("127.0.0.1", store.port)
    groups = GroupKeeper()
    for seed in (1, 2):
        ticket = TransferTicket(f"older-{seed}", (1,), "gloo", 5.0, 10.0)
        tensors = list(tiny_model(config, seed=seed).state_dict().items())
        sending = threading.Thread(target=_older_publisher_update, args=(store, ticket, tensors), daemon=True)
        sending.start()
        received: dict[str, torch.Tensor] = {}
        assert receive_update(address, ticket, 1, device=torch.device("cpu"), sink=received.__setitem__, groups=groups)
        sending.join(30)
        assert list(received) == [name for name, _ in tensors]
        assert all(torch.equal(received[name], tensor) for name, tensor in tensors)
        assert groups.kept_id("gloo") == ticket.id


def test_a_receiver_keeps_its_store_client_and_replaces_it_once_the_trainer_restarts(redis_server, monkeypatch):
    """A kept client serves every update of one store; a new store on the same address (a restarted trainer) costs
    the receiver no update: the dead client is replaced when setting ready fails."""
    config = make_config(redis_server)
    port = free_port()
    address = StoreAddress("127.0.0.1", port)
    receiver = GroupKeeper()
    clients, outcomes, kept = [], [], []
    for trainer in range(2):
        store = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
        publisher = GroupKeeper()  # the trainer's: a restarted one keeps nothing
        for update in range(2):
            ticket = TransferTicket(f"t{trainer}-{update}", (1,), "gloo", 5.0, 10.0)
            tensors = list(tiny_model(config, seed=10 * trainer + update).state_dict().items())
            sent: list = []
            sending = threading.Thread(target=lambda t=ticket, x=tensors: sent.append(
                send_update(store, t, x, device=torch.device("cpu"), groups=publisher)), daemon=True)
            sending.start()
            received: dict[str, torch.Tensor] = {}
            outcomes.append(receive_update(address, ticket, 1, device=torch.device("cpu"), sink=received.__setitem__,
                                           groups=receiver))
            sending.join(30)
            assert sent == [[1]] and all(torch.equal(received[name], tensor) for name, tensor in tensors)
            clients.append(receiver.client(address, 5.0))
            kept.append(receiver.kept_id("gloo"))
        publisher.close()
        del store  # the trainer's store server stops
    assert outcomes == [True] * 4
    assert clients[0] is clients[1] and clients[2] is clients[3] and clients[1] is not clients[2]
    assert kept == ["t0-0", "t0-0", "t1-0", "t1-0"]  # the restarted trainer formed a new group, kept again after
    # No store at all: the dead kept client is replaced once, a new connection is not retried (each connect attempt
    # costs a whole join timeout).
    connects = []
    real_connect = transfer.connect_store
    monkeypatch.setattr(transfer, "connect_store", lambda *args: connects.append(args) or real_connect(*args))
    for attempt in ("kept client", "no client"):
        connects.clear()
        with pytest.raises(TransferFailed):
            receive_update(address, TransferTicket(f"down-{attempt}", (1,), "gloo", 1.0, 10.0), 1,
                           device=torch.device("cpu"), sink=lambda *_: None, groups=receiver)
        assert len(connects) == 1, attempt
        assert receiver.kept_client(address) is None
