"""Helpers of the rollout tests: a small job config, a tiny model, and a rollout worker run on a thread."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch

from portutil import free_port
from rljob_api import protocol
from rljob_api.config import JobConfig, RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_wire.model import build_model, build_tokenizer
from rljob_rollout.backends.cpu import CpuBackend
from rljob_rollout.tasks import build_task
from rljob_rollout.worker import RolloutWorker
from rljob_wire.connection import connect
from waiting import wait_until  # noqa: F401 - re-exported for the rollout tests

SMALL = {"layers": 1, "hiddenSize": 16, "heads": 2, "intermediateSize": 32, "maxPositionEmbeddings": 32}
"""A model small enough for tests that only need some weights."""
TOY = {"layers": 2, "hiddenSize": 64, "heads": 4, "intermediateSize": 256, "maxPositionEmbeddings": 32}
"""DESIGN §10's model: 2 layers, width 64."""


def make_config(
    redis_server: Any,
    *,
    tiny: Optional[dict] = None,
    rollout: Optional[dict] = None,
    trainer: Optional[dict] = None,
    redis: Optional[dict] = None,
    algorithm: Optional[dict] = None,
    model: Optional[dict] = None,
) -> JobConfig:
    """A resolved config: tiny model (or ``model``, the whole ``spec.model``), one CPU rollout replica, trainer master
    and transfer store on loopback."""
    spec = RLTrainingJobSpec.model_validate(
        {
            "model": model or {"source": "tiny", "tiny": tiny or SMALL},
            "algorithm": algorithm or {},
            "trainer": {"collectiveTimeoutSeconds": 60, **(trainer or {})},
            "rollout": {"promptsPerBatch": 4, "samplesPerPrompt": 4, **(rollout or {})},
            "redis": redis or {},
        }
    )
    config = resolve("job", "ns", spec, RedisConnection(host=redis_server.host, port=redis_server.port))
    return config.model_copy(update={"trainer_master_host": "127.0.0.1", "weights_port": free_port()})


def tiny_model(config: JobConfig, seed: int) -> torch.nn.Module:
    """The job's tiny model with seed ``seed`` (different seeds give different weights)."""
    return build_model(config.spec.model, build_tokenizer(config.spec.model, config.spec.rollout.task).vocab_size, seed=seed)


def make_worker(config: JobConfig, password: str, *, replica_index: int = 0, seed: int = 0) -> RolloutWorker:
    """A CPU rollout worker of ``config`` with its own Redis client (the real worker's ``connect``)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
    backend = CpuBackend(tiny_model(config, seed=1000 + seed), pad_token_id=0, eos_token_id=tokenizer.eos_token_id)
    task = build_task(config.spec.rollout.task, tokenizer, seed)
    return RolloutWorker(config, replica_index, client=connect(config, password=password), backend=backend, task=task, tokenizer=tokenizer)


@contextlib.contextmanager
def running(worker: RolloutWorker) -> Iterator[dict]:
    """Run ``worker.run()`` on a thread; on exit stop it and join. The yielded dict gets ``rc`` / ``error``."""
    result: dict = {}

    def target() -> None:
        try:
            result["rc"] = worker.run()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            result["error"] = error

    thread = threading.Thread(target=target, name="rollout-worker", daemon=True)
    thread.start()
    result["thread"] = thread
    try:
        yield result
    finally:
        worker.stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the rollout worker did not stop within 60 s"


def rollout_rewards(client: Any, key: str) -> dict[int, tuple[float, int]]:
    """Per weights version: (mean reward, number of scored samples), from the rollout hash ``key``."""
    return protocol.rewards_by_version(client.hgetall(key))
