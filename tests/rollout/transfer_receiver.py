"""A weight-transfer receiver process for the tests: heartbeats, follows events, saves every update it gets.

``python transfer_receiver.py CONFIG REPLICA OUT_DIR [DIE_AFTER]``: each complete update with documents_seen v
is saved as ``OUT_DIR/<replica>-<v>.pt`` (a dict name -> tensor). With DIE_AFTER = k the process exits at once
(``os._exit``) after receiving k tensors of its second update: a pod lost in the middle of a transfer.
Exits 0 on training_finished.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rljob_api.config import JobConfig
from rljob_trainer.stream.connection import connect
from rljob_rollout.weights import WeightSubscriber
from rljob_trainer.transfer import TransferFailed, receive_update


def main() -> int:
    torch.set_num_threads(1)
    config = JobConfig.load(sys.argv[1])
    replica, out = int(sys.argv[2]), Path(sys.argv[3])
    die_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
    subscriber = WeightSubscriber(config, connect(config), replica)
    subscriber.follow_from_now()
    subscriber.start_heartbeats(interval_s=0.5)
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
                if die_after is not None and updates == 1 and len(received) >= die_after:
                    os._exit(17)

            try:
                if receive_update(subscriber.address, event.ticket, subscriber.transfer_ranks[0], device=torch.device("cpu"), sink=sink):
                    final = out / f"{replica}-{event.documents_seen}.pt"
                    partial = final.with_suffix(".partial")
                    torch.save(received, partial)
                    partial.rename(final)  # the test polls for the final name: it must never see half a file
                    subscriber.version = event.documents_seen
                    subscriber.heartbeat()
                    updates += 1
            except TransferFailed as error:
                print(f"receiver {replica}: {error}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
