"""A trainer's weight publication that stalls half-way, for a test to kill from outside: ``python stalling_publisher.py
CONFIG DOCUMENTS_SEEN SEED STALL_AFTER [BUCKET_BYTES]`` publishes the job's tiny model (``SEED``) as version
``DOCUMENTS_SEEN`` with a real :class:`~rljob_trainer.weight_publisher.WeightPublisher` (packed in buckets of
``BUCKET_BYTES`` when given and the receivers read it, else per-tensor), prints ``sent N`` after handing it each tensor
and sleeps for good after ``STALL_AFTER`` of them (REDIS_PASSWORD in the environment)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rljob_api.config import JobConfig
from rljob_trainer.weight_publisher import WeightPublisher
from rljob_wire.connection import connect
from rollout_harness import tiny_model


def main() -> int:
    config = JobConfig.from_json(Path(sys.argv[1]).read_text())
    documents_seen, seed, stall_after = (int(arg) for arg in sys.argv[2:5])
    bucket_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else None
    publisher = WeightPublisher(config, connect(config), join_timeout_s=10, transfer_timeout_s=30,
                                serve_late_joiners=False, bucket_bytes=bucket_bytes)
    model = tiny_model(config, seed)

    def tensors():
        for sent, pair in enumerate(model.named_parameters(), start=1):
            yield pair
            print(f"sent {sent}", flush=True)
            if sent == stall_after:
                time.sleep(3600)

    publisher.publish(tensors(), step=1, documents_seen=documents_seen,
                      tensors=[(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
