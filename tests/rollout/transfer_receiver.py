"""A weight-transfer receiver process for the tests: heartbeats, follows events, saves every update it gets.

``python transfer_receiver.py CONFIG REPLICA OUT_DIR [--die-after K] [--fresh-groups]``: each complete update with
documents_seen v is saved as ``OUT_DIR/<replica>-<v>.pt`` (a dict name -> tensor). With ``--die-after K`` the process
exits at once (``os._exit``) after receiving K tensors of its second update: a pod lost in the middle of a transfer.
It keeps its transfer group between updates as the rollout backends do (a ``GroupKeeper``), or with
``--fresh-groups`` keeps none, as an older receiver did. Exits 0 on training_finished.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from rljob_api.config import JobConfig
from rljob_wire.connection import connect
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_wire.transfer import GroupKeeper, TransferFailed, receive_update


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("replica", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--fresh-groups", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = JobConfig.load(args.config)
    subscriber = WeightSubscriber(config, connect(config), args.replica)
    subscriber.follow_from_now()
    subscriber.start_heartbeats(interval_s=0.5)
    groups = None if args.fresh_groups else GroupKeeper()
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
                                  sink=sink, groups=groups):
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
