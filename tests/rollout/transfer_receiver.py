"""A weight-transfer receiver process for the tests: heartbeats, follows events, saves every update it gets.

``python transfer_receiver.py CONFIG REPLICA OUT_DIR [--die-after K] [--fresh-groups] [--per-tensor-only]
[--kept-buffers]``: each complete update with
documents_seen v is saved as ``OUT_DIR/<replica>-<v>.pt`` (a dict name -> tensor). With ``--die-after K`` the process
exits at once (``os._exit``) after receiving K tensors of its second update: a pod lost in the middle of a transfer.
It keeps its transfer group between updates as the rollout backends do (a ``GroupKeeper``), or with
``--fresh-groups`` keeps none, as an older receiver did; with ``--per-tensor-only`` it announces no layout (heartbeats
and ready records), as a receiver before the packed layout; with ``--kept-buffers`` it receives into buffers kept
across updates, one per name, and two bucket slots (``ReceiveBuffers`` and ``BucketBuffers()``: a packed tensor with a
bucket of its own lands in its buffer directly). Each update's layout (the transfer store's) is appended to
``OUT_DIR/<replica>.layouts``. Exits 0 on training_finished.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed import PrefixStore

from rljob_api.config import JobConfig
from rljob_wire.connection import connect
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_wire.packed import LAYOUTS, BucketBuffers
from rljob_wire.transfer import (LAYOUT_KEY, STORE_PREFIX, GroupKeeper, ReceiveBuffers, TransferFailed, connect_store,
                                 receive_update)


def layout_of(subscriber: WeightSubscriber, ticket) -> str:
    """The layout the publisher wrote for ``ticket``'s update (none written: per-tensor)."""
    store = PrefixStore(f"{STORE_PREFIX}{ticket.id}/", connect_store(subscriber.address, 10))
    return store.get(LAYOUT_KEY).decode() if store.check([LAYOUT_KEY]) else "per-tensor"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("replica", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--fresh-groups", action="store_true")
    parser.add_argument("--per-tensor-only", action="store_true")
    parser.add_argument("--kept-buffers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = JobConfig.load(args.config)
    layouts = () if args.per_tensor_only else LAYOUTS
    subscriber = WeightSubscriber(config, connect(config), args.replica, layouts=layouts)
    subscriber.follow_from_now()
    subscriber.start_heartbeats(interval_s=0.5)
    groups = None if args.fresh_groups else GroupKeeper()
    buffers, staging = (ReceiveBuffers(), BucketBuffers()) if args.kept_buffers else (None, None)
    updates = 0
    while True:
        for event in subscriber.poll(block_ms=200):
            if event.type == "training_finished":
                subscriber.leave()
                return 0
            if event.ticket is None or subscriber.transfer_ranks[0] not in event.ticket.members:
                continue
            received: dict[str, torch.Tensor] = {}

            def sink(name: str, tensor: torch.Tensor) -> None:
                received[name] = tensor
                if args.die_after is not None and updates == 1 and len(received) >= args.die_after:
                    os._exit(17)

            try:
                if receive_update(subscriber.address, event.ticket, subscriber.transfer_ranks[0], device=torch.device("cpu"),
                                  sink=sink, groups=groups, layouts=layouts, buffers=buffers, staging=staging):
                    with (args.out / f"{args.replica}.layouts").open("a") as log:
                        log.write(f"{event.documents_seen} {layout_of(subscriber, event.ticket)}\n")
                    final = args.out / f"{args.replica}-{event.documents_seen}.pt"
                    partial = final.with_suffix(".partial")
                    torch.save(received, partial)
                    partial.rename(final)  # the test polls for the final name: it must never see half a file
                    subscriber.version = event.documents_seen
                    subscriber.heartbeat()
                    updates += 1
            except TransferFailed as error:
                print(f"receiver {args.replica}: {error}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
