"""The trainer entrypoint: ``torchrun … -m rljob_trainer.train`` (DESIGN §2), or :func:`run` in process.

Joins the gang (:func:`rljob_trainer.parallel.init_distributed`), waits for Redis (and later rides out Redis
restarts of up to :data:`~rljob_wire.connection.OUTAGE_SECONDS`), then builds a
:class:`rljob_trainer.trainer.Trainer` (one step and one start are described there), resumes and trains until
``maxSteps``: final checkpoint, safetensors export, ``training_finished``, exit 0. Logs go to stderr, one JSON
line per step to stdout. A rank that cannot start (:class:`~rljob_api.start_failure.StartFailure`: a model that cannot
be loaded, said with its field and value) writes the failure's line to the termination message file, logs it last and
exits :data:`~rljob_api.constants.EXIT_START_FAILED` (permanent) or :data:`~rljob_api.constants.EXIT_START_RETRY`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, TextIO

import redis

from rljob_api.config import JobConfig
from rljob_api.start_failure import StartFailure
from rljob_trainer.parallel import init_distributed, shutdown_distributed
from rljob_wire.connection import OUTAGE_SECONDS, connect, retry_with_backoff
from rljob_trainer.trainer import RunResult, Trainer

__all__ = ["RunResult", "main", "run"]

log = logging.getLogger("rljob_trainer")


def run(config: JobConfig, *, client: Optional[redis.Redis] = None, stdout: TextIO = sys.stdout) -> RunResult:
    """Train one job on this process's rank until ``maxSteps``; the in-process form of the entrypoint.

    Under torchrun it joins the gang from the env; without it (tests) it forms a world of one. The process
    group is destroyed on return, also on failure.

    Raises:
        rljob_trainer.parallel.WorldSizeMismatch: WORLD_SIZE / (TP × PP) ≠ the config's DP size.
        rljob_wire.connection.RedisUnavailable: Redis unreachable for ``rendezvousTimeoutSeconds`` at start.
        rljob_trainer.stream.reader.DataTimeout: no document arrived for ``dataTimeoutSeconds``.
        FileNotFoundError: ``initFrom`` names no committed checkpoint.
        StartFailure: the model's tokenizer, config or weights cannot be loaded (rljob_wire.model.load_from).
    """
    where = init_distributed(config)
    trainer = None
    try:
        client = client or connect(config, outage_seconds=OUTAGE_SECONDS)  # rides out a Redis pod restart
        # Redis may still be starting (managed Redis comes up with the gang): wait for it as for the gang,
        # rather than exiting and costing a gang restart.
        retry_with_backoff(client.ping, "connect to Redis", config.spec.trainer.rendezvous_timeout_seconds)
        trainer = Trainer(config, where, client, stdout)
        trainer.resume()
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()


def main() -> int:
    """Console entry: load ``RLJOB_CONFIG``, train, exit 0 at ``maxSteps`` (a start failure: see the module
    docstring)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        record(lambda: run(JobConfig.load()))()
    except StartFailure as failure:  # what the operator reads back from the pod (rljob_api.start_failure)
        failure.report()
        log.error("trainer: %s", failure.line)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(failure.exit_code)
    # The run closed and flushed everything it opened. torch 2.13's interpreter teardown after a finished gloo run
    # now and then aborts (SIGABRT, "terminate called without an active exception": a joinable native thread
    # destroyed), turning a finished run into a failed one; ending without that teardown avoids it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
