"""``python -m rljob_rollout``: the rollout pod's entry point (DESIGN §2).

Reads the resolved config (env ``RLJOB_CONFIG``), the replica index (env ``RLJOB_REPLICA_INDEX``, required when
``spec.rollout.replicas`` > 1), the reward module's file (env ``RLJOB_REWARD_SOURCE``, with
``spec.rollout.task.rewardSource``) and the Redis password (env ``REDIS_PASSWORD``), serves Prometheus metrics
(:mod:`.metrics`) on ``config.metrics_port`` at env ``POD_IP``, then runs
:class:`~rljob_rollout.worker.RolloutWorker` until ``training_finished`` (exit 0) or SIGTERM (exit 0).
Exit 2: bad config, replica index, task, dataset or reward module (the last log line names the field; a reward module
from a ConfigMap is fixed by editing the ConfigMap, which replaces the pod). Exit
:data:`~rljob_api.constants.EXIT_START_FAILED` (78) or :data:`~rljob_api.constants.EXIT_START_RETRY` (75): a
:class:`~rljob_api.start_failure.StartFailure` (a model that cannot be loaded, a backend the image lacks, a model vLLM's
CPU attention cannot run, a memory limit too small for its KV cache), its line written to the termination message file
and logged last; the operator fails the job on a permanent one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional

from rljob_api import constants as c
from rljob_api.config import JobConfig
from rljob_api.start_failure import StartFailure

log = logging.getLogger("rljob_rollout")


def replica_index(config: JobConfig, environ: Optional[dict[str, str]] = None) -> int:
    """This pod's replica index from env ``RLJOB_REPLICA_INDEX`` (default 0 for a single replica).

    Raises:
        ValueError: missing with several replicas, not an integer, or outside [0, replicas) (with autoscaling, the
            larger of replicas and maxReplicas: the operator runs the autoscaler's count).
    """
    env = os.environ if environ is None else environ
    autoscaling = config.spec.rollout.autoscaling
    replicas = config.spec.rollout.replicas if autoscaling is None else max(config.spec.rollout.replicas,
                                                                            autoscaling.max_replicas)
    field = "spec.rollout.replicas" if autoscaling is None else "spec.rollout.autoscaling.maxReplicas"
    raw = env.get(c.ENV_REPLICA_INDEX)
    if raw is None:
        if replicas == 1:
            return 0
        raise ValueError(f"env {c.ENV_REPLICA_INDEX}: required with spec.rollout.replicas = {replicas}")
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"env {c.ENV_REPLICA_INDEX}: not an integer: {raw!r}") from None
    if not 0 <= index < replicas:
        raise ValueError(f"env {c.ENV_REPLICA_INDEX}: {index} is outside [0, {field} = {replicas})")
    return index


def reward_file(config: JobConfig, environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """The file of ``spec.rollout.task.rewardSource`` (or ``environment.python.source``: the two never go together) in
    this container, from env ``RLJOB_REWARD_SOURCE`` (the operator sets it where it mounts the file); None without
    one.

    Raises:
        ValueError: a reward source but no env.
    """
    env = os.environ if environ is None else environ
    rollout = config.spec.rollout
    python = rollout.environment.python if rollout.environment is not None else None
    if rollout.task.reward_source is None and (python is None or python.source is None):
        return None
    file = env.get(c.ENV_REWARD_SOURCE)
    if not file:
        field = "task.rewardSource" if rollout.task.reward_source is not None else "environment.python.source"
        raise ValueError(f"env {c.ENV_REWARD_SOURCE}: required with spec.rollout.{field} (the operator sets it on "
                         "rollout pods)")
    return file


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = JobConfig.load()
        index = replica_index(config)
        from rljob_rollout.worker import RolloutWorker

        worker = RolloutWorker.from_config(config, index, reward_file(config))
    except StartFailure as failure:  # what the operator reads back from the pod (rljob_api.start_failure)
        failure.report()
        log.error("rollout: %s", failure.line)
        return failure.exit_code
    except (OSError, ValueError, ImportError) as error:
        log.error("rollout: cannot start: %s", error)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        port = worker.metrics.serve(config.metrics_port, os.environ.get(c.ENV_POD_IP, "0.0.0.0"))
    except OSError as error:
        log.warning("rollout: no Prometheus endpoint (port %d: %s)", config.metrics_port, error)
        port = None
    log.info("rollout: replica %d of job %s/%s, transfer ranks %s, metrics port %s", index, config.namespace,
             config.name, list(worker.subscriber.transfer_ranks), port)
    try:
        return worker.run()
    finally:
        worker.metrics.close()
        worker.backend.close()


if __name__ == "__main__":
    sys.exit(main())
