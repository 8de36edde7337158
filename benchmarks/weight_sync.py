"""Weight sync: one publication of a DDP trainer's weights to a rollout process, in the packed layout and in the
per-tensor one, beside a raw broadcast of the same bytes; and an FSDP trainer's packed publication beside its gathers
plus that raw broadcast.

Processes (real ones, gloo on loopback or NCCL between two GPUs, a real redis-server):

- this process is global rank 0 of a DDP trainer: a random Llama of ``--params`` million parameters (plain
  tensors, as DDP holds them) and a real :class:`~rljob_trainer.weight_publisher.WeightPublisher`; each publication is one
  :func:`~rljob_trainer.weight_publisher.publish_weights` call (the ``weight_sync_time_ms`` the trainer reports: weights_ready
  event, join handshake, the transfer group (kept from the first publication, which is not timed), every tensor in
  the layout of DESIGN §3 the receiver announced: packed in buckets of ``--bucket-mb``, the packing copy included,
  and per-tensor with packing switched off on the publisher, the two alternating; the late-joiner copy); the packed
  publication's phases (``Publication.phases_ms``) are printed too;
- one rollout process (``--receivers`` of them, replicas 0, 1, ...): the real subscriber (:class:`~rljob_rollout.weight_subscriber.WeightSubscriber`: heartbeats, events) and
  the CPU backend's real receive path (:meth:`CpuBackend.receive_weights`: staging buffers, then loading into its
  own model of the same architecture); with ``--device cuda`` the receive path of vLLM's worker extension instead
  (:func:`~rljob_wire.transfer.receive_update` onto the second GPU, into buffers kept across updates, with the
  group kept; no vLLM, so nothing is loaded into a model);
- for the FSDP figure, two trainer ranks set up as the trainer sets them up (:func:`~rljob_trainer.parallel.
  init_distributed` and :func:`~rljob_trainer.parallel.wrap_model` with ``strategy: fsdp``: ``fully_shard`` per
  decoder layer, on the embedding and the output projection, then the root; a gloo world of 2) that publish the same
  weights to the same rollout process.

Raw baseline, in the same run on the same two processes: one broadcast of all the published bytes as one flat uint8
tensor over a gloo group formed once beforehand (buffers allocated and touched once, reused), timed on the root.
Raw and ours alternate ``--repeats`` times so that machine noise hits both alike; the best run of each counts (the
median is printed too). Also "raw per tensor": the same tensors broadcast one after the other without metadata;
and, for information, "raw layout": every broadcast the per-tensor layout makes (per tensor the pickled metadata's
size and bytes, then the tensor; the closing None) started at once and then waited for, which only a receiver that
knew every size beforehand could do: the most any implementation of that layout can get from this transport. Targets:
the packed publication >= 80% of the raw rate, taken as the faster of the two raw ways (on a loaded machine gloo has
sent the same bytes faster tensor by tensor than as one flat tensor), plus, when the published dtype is not the model's
(bf16 from float32 weights), the cast of the model's floating-point tensors into kept buffers measured in the same run:
a raw broadcast of bf16 bytes presumes weights already in bf16, and any publication from float32 weights casts them
first (as the FSDP bound below adds the gathers); the FSDP publication (packed) >= 80% of a bound
measured in the same run: its own gathers plus the raw broadcast. The per-tensor publication is a figure only. The
rollout's weights are checked bit for bit after a packed and after a per-tensor DDP publication, and after the FSDP
publications.

    python benchmarks/weight_sync.py                      # 125M parameters, float32 (about 1 minute on 2 cores)
    python benchmarks/weight_sync.py --params 500 --repeats 3
    python benchmarks/weight_sync.py --dtype bfloat16     # publish bf16 (cast on rank 0 / on the shards)
    python benchmarks/weight_sync.py --bucket-mb 16       # smaller buckets
    python benchmarks/weight_sync.py --receivers 2        # two rollout processes receive each update
    python benchmarks/weight_sync.py --device cuda --params 6740 --dtype bfloat16   # NCCL, GPU 0 -> GPU 1 (no FSDP)
    python benchmarks/weight_sync.py --device cuda-receiver --no-fsdp              # gloo, CPU -> GPU 0 (one GPU)

Exit status: 0 when every target is met, 1 when one is missed, 2 on an error.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_throughput import start_redis  # noqa: E402 - a sibling script

from rljob_api import RLTrainingJobSpec, resolve  # noqa: E402
from rljob_api.config import JobConfig, RedisConnection  # noqa: E402
from rljob_wire.packed import DEFAULT_BUCKET_BYTES  # noqa: E402

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
WAIT_S = 600
"""The longest any process waits for another's command or reply (seconds); every Redis client's socket timeout
exceeds it (redis-py's default of 5 s would cut a blocking pop short on a loaded machine)."""
COMMANDS = "bench:weight_sync:commands"
REPLIES = "bench:weight_sync:replies"
TARGET = 0.8
"""Ours >= this share of the raw rate."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --- the model: a random Llama of about P parameters, the same on every process -----------------------------------
def llama_config(params_millions: float) -> Any:
    """A Llama config of about ``params_millions`` million parameters (vocabulary 32000, untied head): width 768
    below 300M, 1536 below 3000M, Llama-2-7B's 4096 (intermediate 11008, 32 heads) from there (6740: its 32 blocks)."""
    from transformers import LlamaConfig

    if params_millions < 300:
        hidden, intermediate, heads = 768, 2048, 12
    elif params_millions < 3000:
        hidden, intermediate, heads = 1536, 4096, 12
    else:
        hidden, intermediate, heads = 4096, 11008, 32
    vocab = 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((params_millions * 1e6 - 2 * vocab * hidden - hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False)


def build_model(params_millions: float, seed: int, device: Any = "cpu") -> torch.nn.Module:
    """The benchmark's model, float32 on ``device``, parameters uniform in [-0.02, 0.02) from ``seed`` (fast: no HF
    init); on the meta device, shapes only."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(params_millions))
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(-0.02, 0.02, generator=generator)
    return model


def digest(named: Any) -> str:
    """sha256 over every (name, dtype, shape, bytes) by name: equal digests = bit-identical tensors."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        tensor = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def make_config(redis_port: int, weights_port: int) -> JobConfig:
    trainer = {"collectiveTimeoutSeconds": 600, "processesPerNode": 2, "parallelism": {"strategy": "fsdp"}}
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": trainer})
    config = resolve("bench", "bench", spec, RedisConnection(host="127.0.0.1", port=redis_port))
    return config.model_copy(update={"trainer_master_host": "127.0.0.1", "weights_port": weights_port})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the raw baseline (both ends) ------------------------------------------------------------------------------
def devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    """(the driver's device, rollout process ``--index``'s): CPU and CPU; GPU 0 and GPU 1 + index (``cuda``); CPU and
    GPU index (``cuda-receiver``: gloo from the CPU into a GPU, the one-GPU check)."""
    if args.device == "cuda":
        return torch.device("cuda", 0), torch.device("cuda", 1 + args.index)
    if args.device == "cuda-receiver":
        return torch.device("cpu"), torch.device("cuda", args.index)
    return torch.device("cpu"), torch.device("cpu")


def raw_group(rank: int, port: int, device: torch.device, world_size: int) -> Any:
    """The raw baseline's group (the driver as rank 0, rollout process i as rank 1 + i): gloo on CPU, NCCL on a
    GPU; and its store."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=300)
    store = TCPStore("127.0.0.1", port, world_size, rank == 0, timeout)
    if device.type == "cpu":
        return ProcessGroupGloo(PrefixStore("raw/", store), rank, world_size, timeout), store
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(PrefixStore("raw/", store), rank, world_size, options), store


def start_broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast of ``tensor`` from group rank 0; returns its Work."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """A broadcast from group rank 0, complete on return (on a GPU: the device synchronised)."""
    start_broadcast(group, tensor).wait()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def raw_buffers(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A receiver's raw buffers on ``device``: one flat uint8 tensor of the published bytes, touched once (warm, as
    ours are after the first update), and a view of it per published tensor ([shape] of its published dtype);
    ``model`` may be on the meta device (only its shapes are read)."""
    state = model.state_dict().values()
    dtypes = [dtype if t.is_floating_point() else t.dtype for t in state]
    sizes = [t.numel() * torch.empty((), dtype=d).element_size() for t, d in zip(state, dtypes)]
    flat = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for t, d, size in zip(state, dtypes, sizes):
        views.append(flat[offset:offset + size].view(d).view(t.shape))
        offset += size
    return flat, views


def layout_tensors(names: list[str], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor the per-tensor layout of DESIGN §3 broadcasts for ``tensors`` (and their ``names``), in order:
    per tensor the size (int64 [1]) and bytes (uint8 [n]) of its pickled metadata, then the tensor; then the
    ``None`` object's two; on the tensors' device. The same on both ends (the metadata is pickled the way the
    publisher pickles it)."""
    from rljob_wire.transfer import SHARD_NAME

    device = tensors[0].device

    def object_tensors(obj: Any) -> list[torch.Tensor]:
        payload = pickle.dumps(obj)
        return [torch.tensor([len(payload)], dtype=torch.int64, device=device),
                torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)]

    out: list[torch.Tensor] = []
    for name, tensor in zip(names, tensors):
        out += object_tensors((SHARD_NAME, name, tuple(tensor.shape), tensor.dtype)) + [tensor]
    return out + object_tensors(None)


def raw_round(group: Any, flat: torch.Tensor, tensors: list[torch.Tensor], mode: str) -> float:
    """One raw round after a one-element sync; seconds on this end. ``mode``: ``flat`` (one broadcast of ``flat``),
    ``per-tensor`` (each of ``tensors`` in turn, each waited for) or ``layout`` (every broadcast of
    :func:`layout_tensors` started at once, then all waited for)."""
    broadcast(group, torch.zeros(1, device=flat.device))
    started = time.perf_counter()
    if mode == "per-tensor":
        for tensor in tensors:
            broadcast(group, tensor)
    elif mode == "layout":
        for work in [start_broadcast(group, tensor) for tensor in tensors]:
            work.wait()
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
    else:
        broadcast(group, flat)
    return time.perf_counter() - started


# --- the rollout process -----------------------------------------------------------------------------------------
class GpuReceiver:
    """The rollout end on a GPU (``--device cuda`` or ``cuda-receiver``): ``receive_update`` onto its GPU with the
    group kept, as vLLM's worker extension receives an NCCL update, each tensor unpacked (a packed update: copied out
    of its bucket, or received in place when it fills a bucket of its own) into a buffer of its own kept across
    updates; no vLLM, so nothing is loaded into a model."""

    def __init__(self, device: torch.device) -> None:
        from rljob_wire.packed import BucketBuffers
        from rljob_wire.transfer import GroupKeeper, ReceiveBuffers

        self.device = device
        self.staging = ReceiveBuffers()
        self.buckets = BucketBuffers()
        self.groups = GroupKeeper()

    def receive_weights(self, ticket: Any, address: Any, transfer_ranks: Any) -> Any:
        from rljob_rollout.backends.base import UpdateOutcome
        from rljob_wire.transfer import TransferFailed, receive_update

        try:
            selected = receive_update(address, ticket, transfer_ranks[0], device=self.device, sink=lambda *_: None,
                                      buffers=self.staging, groups=self.groups, staging=self.buckets)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except TransferFailed as error:
            print(f"weight_sync: the GPU receiver's update failed: {error}", file=sys.stderr)
            return UpdateOutcome.FAILED_INTACT
        return UpdateOutcome.LOADED if selected else UpdateOutcome.NOT_SELECTED


def rollout_main(args: argparse.Namespace) -> int:
    """Rollout process ``--index``: subscriber (replica ``--index``) + CPU backend (or :class:`GpuReceiver`); raw
    rounds on command (its own list of COMMANDS); replies on REPLIES, which all rollout processes share."""
    from rljob_rollout.backends.cpu import CpuBackend
    from rljob_rollout.weight_subscriber import WeightSubscriber
    from rljob_wire.connection import connect

    torch.set_num_threads(1)
    _, device = devices(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = JobConfig.load(args.config)
    client = connect(config, socket_timeout=WAIT_S + 60)
    if device.type == "cuda":
        backend, shapes = GpuReceiver(device), build_model(args.params, seed=0, device="meta")
    else:
        backend = CpuBackend(build_model(args.params, seed=12345), pad_token_id=0, eos_token_id=None)
        shapes = backend.model
    subscriber = WeightSubscriber(config, client, replica_index=args.index)
    subscriber.follow_from_now()
    subscriber.start_heartbeats(interval_s=0.5)
    group, _store = raw_group(1 + args.index, args.raw_port, device, 1 + args.receivers)
    flat, tensors = raw_buffers(shapes, DTYPES[args.dtype], device)
    layout = layout_tensors(list(shapes.state_dict()), tensors)
    client.rpush(REPLIES, "ready")
    while True:
        command = client.lpop(f"{COMMANDS}:{args.index}")
        if command is not None:
            command = command.decode()
            if command == "exit":
                subscriber.leave()
                return 0
            if command.startswith("raw"):
                mode = command.removeprefix("raw-") if command != "raw" else "flat"
                raw_round(group, flat, layout if mode == "layout" else tensors, mode)
                client.rpush(REPLIES, "raw")
            elif command == "digest":  # of the last update as received (staged), in the published dtype
                client.rpush(REPLIES, digest(backend.staging.items()))
            continue
        for event, outcome in receive_updates(subscriber, backend):
            client.rpush(REPLIES, json.dumps({"outcome": outcome.value, "version": event.documents_seen}))


def receive_updates(subscriber: Any, backend: Any, block_ms: int = 20) -> list[tuple[Any, Any]]:
    """One poll of ``subscriber``'s events (waiting at most ``block_ms``): each ``weights_ready`` update received with
    ``backend.receive_weights``, the subscriber's version moved and a heartbeat sent when it loaded. Returns (event,
    :class:`~rljob_rollout.backends.base.UpdateOutcome`) of each update."""
    from rljob_rollout.backends.base import UpdateOutcome

    updates = []
    for event in subscriber.poll(block_ms=block_ms):
        if event.type == "weights_ready" and event.ticket is not None:
            outcome = backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks)
            if outcome == UpdateOutcome.LOADED:
                subscriber.version = event.documents_seen
                subscriber.heartbeat()
            updates.append((event, outcome))
    return updates


# --- the FSDP trainer ranks --------------------------------------------------------------------------------------
def fsdp_main(args: argparse.Namespace) -> int:
    """One rank of a 2-rank FSDP trainer: ``--repeats`` publications; rank 0 reports each on REPLIES."""
    import torch.distributed as dist

    from rljob_trainer.parallel import init_distributed, wrap_model
    from rljob_wire.connection import connect
    from rljob_trainer.weight_publisher import WeightPublisher, publish_weights

    torch.set_num_threads(1)
    config = JobConfig.load(args.config)
    where = init_distributed(config)  # the trainer's own: gloo, the data-parallel mesh of 2
    rank = where.rank
    model = wrap_model(build_model(args.params, seed=args.seed), where, config.spec.trainer).model
    client = connect(config, socket_timeout=WAIT_S + 60)
    publisher = WeightPublisher(config, client, serve_late_joiners=True, poll_interval_s=3600,
                                bucket_bytes=int(args.bucket_mb * 2**20)) if rank == 0 else None
    dtype = DTYPES[args.dtype] if args.dtype != "float32" else None
    for repeat in range(1 + args.repeats):  # the first one allocates the late-joiner copy: not reported
        dist.barrier()
        if rank == 0:
            client.blpop([COMMANDS + ":fsdp"], timeout=WAIT_S)  # the driver says the rollout process is idle
        dist.barrier()
        publication = publish_weights(model, publisher, step=100 + repeat, documents_seen=1000 + repeat, dtype=dtype)
        if rank == 0:
            client.rpush(REPLIES + ":fsdp", json.dumps({"duration_ms": publication.duration_ms,
                                                         "gather_ms": publication.gather_ms,
                                                         "receivers": publication.receivers,
                                                         "layout": publication.layout}))
    dist.barrier()
    if publisher is not None:
        publisher.close()
    dist.destroy_process_group()
    return 0


# --- the driver -------------------------------------------------------------------------------------------------
def wait_reply(client: redis.Redis, key: str = REPLIES, timeout_s: float = WAIT_S) -> str:
    reply = client.blpop([key], timeout=timeout_s)
    if reply is None:
        raise SystemExit(f"no reply on {key} within {timeout_s} s")
    return reply[1].decode()


def ask_rollouts(client: redis.Redis, receivers: int, command: str) -> list[str]:
    """Send ``command`` to every rollout process; their replies, one each (in the order they came)."""
    for index in range(receivers):
        client.rpush(f"{COMMANDS}:{index}", command)
    return [wait_reply(client) for _ in range(receivers)]


def wait_loaded(client: redis.Redis, receivers: int) -> list[dict]:
    """The update replies of every rollout process."""
    return [json.loads(wait_reply(client)) for _ in range(receivers)]


def child(role: str, args: argparse.Namespace, config_path: Path, raw_port: int, extra_env: Optional[dict] = None,
          index: int = 0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    command = [sys.executable, str(HERE), "--role", role, "--config", str(config_path), "--params", str(args.params),
               "--dtype", args.dtype, "--repeats", str(args.repeats), "--raw-port", str(raw_port), "--seed", str(args.seed),
               "--device", args.device, "--receivers", str(args.receivers), "--index", str(index)]
    return subprocess.Popen(command, env=env)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement; returns the figures (seconds, bytes, digests)."""
    from rljob_trainer.weight_publisher import WeightPublisher, publish_weights

    torch.set_num_threads(1)
    process, url, data_dir = start_redis()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    client = redis.Redis(port=port, socket_timeout=WAIT_S + 60)
    config = make_config(port, free_port())
    config_path = Path(data_dir) / "config.json"
    config_path.write_text(config.to_json())
    raw_port = free_port()
    children: list[subprocess.Popen] = []
    figures: dict[str, Any] = {"load_start": os.getloadavg()[0]}
    try:
        children += [child("rollout", args, config_path, raw_port, index=i) for i in range(args.receivers)]
        device, _ = devices(args)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group, _store = raw_group(0, raw_port, device, 1 + args.receivers)
        model = build_model(args.params, seed=args.seed, device=device)
        dtype = DTYPES[args.dtype] if args.dtype != "float32" else None
        state = model.state_dict()
        sent = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in state.values()]
        flat = torch.zeros(sum(t.numel() * t.element_size() for t in sent), dtype=torch.uint8, device=device)
        figures.update(parameters=sum(p.numel() for p in model.parameters()), tensors=len(state), bytes=flat.numel())
        if any(wait_reply(client) != "ready" for _ in range(args.receivers)):
            raise SystemExit("a rollout process did not start")
        bucket_bytes = int(args.bucket_mb * 2**20)
        publisher = WeightPublisher(config, client, poll_interval_s=3600,  # no late joiner here: keep the thread idle
                                    bucket_bytes=bucket_bytes)
        deadline = time.monotonic() + 60
        while len(publisher.live_members()) < args.receivers:
            if time.monotonic() > deadline:
                raise SystemExit("a rollout process never heartbeated")
            time.sleep(0.1)
        # A first publication allocates the late-joiner copy and the rollout's staging buffers: not timed.
        publish_weights(model, publisher, step=0, documents_seen=0, dtype=dtype)
        publisher.settle()
        assert all(reply["outcome"] == "loaded" for reply in wait_loaded(client, args.receivers))
        layout = layout_tensors(list(state), sent)
        raw, raw_per_tensor, raw_layout, ours, per_tensor, copies, phases = [], [], [], [], [], [], []

        def publish(step: int, packed: bool) -> float:
            publisher.bucket_bytes = bucket_bytes if packed else None
            publication = publish_weights(model, publisher, step=step, documents_seen=10 * step, dtype=dtype)
            started = time.perf_counter()
            publisher.settle()  # a trainer calls it before its next optimizer step; here before the next round
            replies = wait_loaded(client, args.receivers)
            if any(reply["outcome"] != "loaded" for reply in replies) or publication.receivers != args.receivers \
                    or publisher.last_layout != ("packed" if packed else "per-tensor"):
                raise SystemExit(f"publication {step} did not reach the rollouts as expected: {replies}, "
                                 f"{publication}, {publisher.last_layout}")
            if packed:
                copies.append(time.perf_counter() - started)
                phases.append({**publication.phases_ms,
                               "other": publication.duration_ms - sum(publication.phases_ms.values())})
            return publication.duration_ms / 1e3

        def raw_figure(command: str, tensors: list[torch.Tensor], mode: str) -> float:
            for index in range(args.receivers):
                client.rpush(f"{COMMANDS}:{index}", command)
            seconds = raw_round(group, flat, tensors, mode)
            for _ in range(args.receivers):
                wait_reply(client)
            return seconds

        casts = []

        def cast_round() -> float:
            """Seconds to cast every floating-point tensor of the model into ``sent`` (kept buffers): the work a
            publication in another dtype than the model's does on top of a raw broadcast of the cast bytes."""
            started = time.perf_counter()
            for source, target in zip(state.values(), sent):
                if source.dtype != target.dtype:
                    target.copy_(source)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - started

        for repeat in range(args.repeats):
            if dtype is not None:
                casts.append(cast_round())
            raw.append(raw_figure("raw", sent, "flat"))
            raw_per_tensor.append(raw_figure("raw-per-tensor", sent, "per-tensor"))
            raw_layout.append(raw_figure("raw-layout", layout, "layout"))
            per_tensor.append(publish(2 + 2 * repeat, packed=False))
            ours.append(publish(3 + 2 * repeat, packed=True))
        figures.update(raw=raw, raw_per_tensor=raw_per_tensor, raw_layout=raw_layout, ours=ours, per_tensor=per_tensor, casts=casts,
                       copies=copies, phases=phases, late_joiner_copy=publisher.late_joiner_copy.nbytes,
                       bucket_bytes=bucket_bytes, staging=publisher._staging.nbytes)
        figures["rollout_digest_ddp"] = same_digest(ask_rollouts(client, args.receivers, "digest"))  # after packed
        publish(3 + 2 * args.repeats, packed=False)
        figures["rollout_digest_per_tensor"] = same_digest(ask_rollouts(client, args.receivers, "digest"))
        figures["published_digest"] = digest(publisher.late_joiner_copy.items())
        expected = [(name, t) for name, t in zip(state, sent)]
        figures["expected_digest"] = digest(expected)
        publisher.close()
        del publisher, model, state, sent, flat, expected

        if args.fsdp:
            master = free_port()
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "WORLD_SIZE": "2"}
            ranks = [child("fsdp", args, config_path, raw_port, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
            children += ranks
            fsdp = []
            for _ in range(1 + args.repeats):
                client.rpush(COMMANDS + ":fsdp", "go")
                result = json.loads(wait_reply(client, REPLIES + ":fsdp"))
                replies = wait_loaded(client, args.receivers)
                if any(reply["outcome"] != "loaded" for reply in replies) or result["receivers"] != args.receivers:
                    raise SystemExit(f"FSDP publication did not reach the rollouts: {replies}, {result}")
                fsdp.append(result)
            figures["fsdp"] = fsdp[1:]
            for rank_process in ranks:
                if rank_process.wait(120) != 0:
                    raise SystemExit(f"an FSDP rank exited with {rank_process.returncode}")
            figures["rollout_digest_fsdp"] = same_digest(ask_rollouts(client, args.receivers, "digest"))
        for index in range(args.receivers):
            client.rpush(f"{COMMANDS}:{index}", "exit")
        for rollout in children[:args.receivers]:
            rollout.wait(60)
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        process.terminate()
        process.wait(10)
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)
    figures["load_end"] = os.getloadavg()[0]
    return figures


def same_digest(digests: list[str]) -> str:
    """The digest every rollout process reported, or a marker that cannot equal any digest when they differ."""
    return digests[0] if len(set(digests)) == 1 else f"rollouts disagree: {digests}"


def report(args: argparse.Namespace, f: dict[str, Any]) -> tuple[str, bool]:
    """The table and whether every target is met."""
    megabytes = f["bytes"] / 1e6
    best_raw, best_ours, best_per_tensor = min(f["raw"]), min(f["ours"]), min(f["raw_per_tensor"])
    fastest = min(best_raw, best_per_tensor)  # the raw rate: the faster of the two raw ways
    cast = min(f["casts"]) if f["casts"] else 0.0  # published in another dtype than the model's: any way casts
    ratio = (fastest + cast) / best_ours
    met = ratio >= TARGET
    identical = f["rollout_digest_ddp"] == f["expected_digest"] == f["published_digest"] == f["rollout_digest_per_tensor"]
    best_per_tensor_layout = min(f["per_tensor"])
    transport = {"cuda": f"NCCL, GPU 0 to GPU{f's 1-{args.receivers}' if args.receivers > 1 else ' 1'}",
                 "cuda-receiver": f"gloo from the CPU to GPU{f's 0-{args.receivers - 1}' if args.receivers > 1 else ' 0'}",
                 }.get(args.device, "gloo on loopback")
    receivers = f"{args.receivers} rollout processes" if args.receivers > 1 else "1 rollout process"
    lines = [
        f"model: {f['parameters'] / 1e6:.1f}M parameters, {f['tensors']} tensors, published as {args.dtype}: "
        f"{megabytes:.1f} MB to {receivers} over {transport}; load average {f['load_start']:.2f} at the start, {f['load_end']:.2f} at the end",
        f"{'figure':<46} {'best s':>7} {'median s':>9} {'MB/s':>6} {'vs raw':>7}  target",
        f"{'raw broadcast, one flat tensor':<46} {best_raw:>7.3f} {statistics.median(f['raw']):>9.3f} "
        f"{megabytes / best_raw:>6.0f} {fastest / best_raw:>7.0%}",
        f"{'raw broadcast, tensor by tensor, no metadata':<46} {best_per_tensor:>7.3f} "
        f"{statistics.median(f['raw_per_tensor']):>9.3f} {megabytes / best_per_tensor:>6.0f} "
        f"{fastest / best_per_tensor:>7.0%}",
        f"{'raw, the per-tensor layout, all started at once':<46} {min(f['raw_layout']):>7.3f} "
        f"{statistics.median(f['raw_layout']):>9.3f} {megabytes / min(f['raw_layout']):>6.0f} "
        f"{fastest / min(f['raw_layout']):>7.0%}  info: the layout's bound on this transport; ours is "
        f"{min(f['raw_layout']) / best_ours:.0%} of it",
        f"{'publication, DDP trainer, packed':<46} {best_ours:>7.3f} {statistics.median(f['ours']):>9.3f} "
        f"{megabytes / best_ours:>6.0f} {fastest / best_ours:>7.0%}  {ratio:.0%} of the faster raw"
        f"{' + the cast' if cast else ''} >= {TARGET:.0%}: {'met' if met else 'MISSED'}",
        f"{'publication, DDP trainer, per-tensor':<46} {best_per_tensor_layout:>7.3f} "
        f"{statistics.median(f['per_tensor']):>9.3f} {megabytes / best_per_tensor_layout:>6.0f} "
        f"{fastest / best_per_tensor_layout:>7.0%}  info: the layout upstream readers get",
        f"{'late-joiner copy after the broadcast (settle)':<46} {min(f['copies']):>7.3f} {statistics.median(f['copies']):>9.3f} "
        f"{'':>6} {'':>7}  info: a background thread; the trainer waits for it only before its next optimizer step",
        *([f"{'cast of the float32 weights (kept buffers)':<46} {cast:>7.3f} "
           f"{statistics.median(f['casts']):>9.3f} {'':>6} {'':>7}  the bound is the faster raw way + this cast: "
           f"{cast + fastest:.3f} s"] if f["casts"] else []),
        f"rollout's received tensors bit-identical to the published ones (DDP, packed and per-tensor): "
        f"{'yes' if identical else 'NO'}",
        f"buckets of {f['bucket_bytes'] / 2**20:g} MiB; rank 0 keeps {f['staging'] / 1e6:.1f} MB of them between updates",
        f"late-joiner copy on rank 0: {f['late_joiner_copy'] / 1e6:.1f} MB (the published bytes: "
        f"{'yes' if f['late_joiner_copy'] == f['bytes'] else 'NO'})",
        f"runs (s): raw {', '.join(f'{x:.3f}' for x in f['raw'])}; raw per tensor "
        f"{', '.join(f'{x:.3f}' for x in f['raw_per_tensor'])}; raw layout {', '.join(f'{x:.3f}' for x in f['raw_layout'])}; "
        f"packed {', '.join(f'{x:.3f}' for x in f['ours'])}; per-tensor {', '.join(f'{x:.3f}' for x in f['per_tensor'])}",
        "packed publication's phases on rank 0, median ms (Publication.phases_ms; other = bookkeeping): "
        + ", ".join(f"{name} {statistics.median(p[name] for p in f['phases']):.1f}" for name in f["phases"][0]),
    ]
    if "fsdp" in f:
        shares = [r["gather_ms"] / r["duration_ms"] for r in f["fsdp"]]
        best = min(f["fsdp"], key=lambda r: r["duration_ms"])
        fsdp_ms = [r["duration_ms"] for r in f["fsdp"]]
        same = f["rollout_digest_fsdp"] == f["rollout_digest_ddp"]
        bound = (best["gather_ms"] / 1e3 + fastest) / (best["duration_ms"] / 1e3)
        fsdp_met = bound >= TARGET and all(r["layout"] == "packed" for r in f["fsdp"])
        lines += [
            f"publication, 2-rank FSDP trainer ({best['layout']}): best {best['duration_ms'] / 1e3:.3f} s "
            f"({best_ours * 1e3 / best['duration_ms']:.0%} of the DDP rate), of which gathers {best['gather_ms'] / 1e3:.3f} s "
            f"({best['gather_ms'] / best['duration_ms']:.0%}; median share {statistics.median(shares):.0%}); "
            f"{bound:.0%} of its gathers + the raw broadcast  >= {TARGET:.0%}: {'met' if fsdp_met else 'MISSED'}",
            f"runs (s): FSDP {', '.join(f'{ms / 1e3:.3f}' for ms in fsdp_ms)}",
            f"rollout's received tensors from FSDP bit-identical to those from DDP: {'yes' if same else 'NO'}",
        ]
        identical = identical and same
        met = met and fsdp_met
    return "\n".join(lines), met and identical


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=125, help="model size, millions of parameters")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="published dtype")
    parser.add_argument("--repeats", type=int, default=5, help="timed publications (and raw rounds) of each kind")
    parser.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="skip the FSDP figure")
    parser.add_argument("--device", choices=("cpu", "cuda", "cuda-receiver"), default="cpu",
                        help="cpu: gloo on loopback; cuda: NCCL from GPU 0 to GPU 1 (needs 2 GPUs; no FSDP figure); "
                             "cuda-receiver: gloo from this CPU into GPU 0 (the receive and unpack on one GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--receivers", type=int, default=1,
                        help="rollout processes receiving each update (and the raw broadcasts); cuda: one GPU each")
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20,
                        help="bucket size of the packed layout, MiB (default %(default)g)")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--raw-port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.role == "rollout":
        return rollout_main(args)
    if args.role == "fsdp":
        return fsdp_main(args)
    if args.device == "cuda":
        if torch.cuda.device_count() < 1 + args.receivers:
            print(f"weight_sync: --device cuda needs {1 + args.receivers} GPUs (NCCL refuses two ranks on one "
                  f"device); {torch.cuda.device_count()} visible", file=sys.stderr)
            return 2
        args.fsdp = False  # the FSDP figure is gloo only
    if args.device == "cuda-receiver" and torch.cuda.device_count() < args.receivers:
        print(f"weight_sync: --device cuda-receiver needs a GPU per receiver; {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    try:
        figures = run(args)
    except SystemExit as error:
        print(f"weight_sync: {error}", file=sys.stderr)
        return 2
    text, ok = report(args, figures)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
