"""The rollout hash keeps per-version reward pairs of the newest ``ROLLOUT_REWARD_VERSIONS_KEPT`` versions only
(real Redis), and the operator's progress reader still finds the newest version's reward."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from rollout_harness import make_config
from rljob_api import protocol
from rljob_rollout.writer import BatchReport, DocumentWriter
from rollout_harness import rollout_rewards

STEP = 512
"""Documents per optimizer step: consecutive weights versions differ by this."""


def batch(version: int, rewards: list[float]) -> BatchReport:
    return BatchReport(version, rewards, len(rewards), Counter(), 0, 0, 0.5)


def reward_fields(client, key: str) -> dict[str, list[int]]:
    """Versions present per field prefix (sorted)."""
    names = [k.decode() for k in client.hkeys(key)]
    return {
        prefix: sorted(int(n[len(prefix):]) for n in names if n.startswith(prefix))
        for prefix in (protocol.ROLLOUT_REWARD_SUM_PREFIX, protocol.ROLLOUT_REWARD_COUNT_PREFIX)
    }


def test_hash_keeps_exactly_the_newest_versions_with_their_values(redis_server):
    config = make_config(redis_server)
    client = redis_server.client()
    key, kept = config.keys.rollout, protocol.ROLLOUT_REWARD_VERSIONS_KEPT
    a, b = DocumentWriter(client, config, 0), DocumentWriter(client, config, 1)
    total_versions = kept + 20
    for step in range(total_versions):
        a.report(batch(step * STEP, [step / 1000, 1.0]))  # mean (step/1000 + 1) / 2 over 2 samples
        if step % 3 == 0:
            b.report(batch(step * STEP, [0.0]))  # a second worker adds a third sample to every third version

    newest = [step * STEP for step in range(total_versions - kept, total_versions)]
    assert reward_fields(client, key) == {protocol.ROLLOUT_REWARD_SUM_PREFIX: newest, protocol.ROLLOUT_REWARD_COUNT_PREFIX: newest}
    def expected(step: int) -> tuple[float, int]:
        count = 3 if step % 3 == 0 else 2
        return pytest.approx((step / 1000 + 1.0) / count, abs=1e-12), count

    assert rollout_rewards(client, key) == {version: expected(version // STEP) for version in newest}
    # totals over the whole run are never pruned
    b_reports = len(range(0, total_versions, 3))
    assert int(client.hget(key, "samples_generated")) == 2 * total_versions + b_reports

    # the operator's reader (rljob_operator.redis_io.reads) reports the newest version's mean, rounded for status
    progress = protocol.parse_progress({}, client.hgetall(key))
    step = total_versions - 1
    mean = round((step / 1000 + 1.0) / (3 if step % 3 == 0 else 2), protocol.REWARD_DECIMALS)
    assert (progress.rollout_reward, progress.rollout_model_version) == (mean, newest[-1])


def test_out_of_order_versions_keep_the_largest(redis_server):
    config = make_config(redis_server)
    client = redis_server.client()
    key = config.keys.rollout
    writer = DocumentWriter(client, config, 0, reward_versions_kept=3)
    for version in (1024, 0, 4096, 2048):  # a worker behind the others reports an older version later
        writer.report(batch(version, [1.0]))
    assert sorted(rollout_rewards(client, key)) == [1024, 2048, 4096]
    writer.report(batch(512, [0.5]))  # older than every kept version: added and pruned in the same transaction
    assert rollout_rewards(client, key) == {1024: (1.0, 1), 2048: (1.0, 1), 4096: (1.0, 1)}
    assert client.hget(key, protocol.ROLLOUT_REWARD_VERSION) == b"2048"  # the pruned version is not reported as newest
    assert int(client.hget(key, "samples_generated")) == 5
    writer.report(batch(8192, [0.25, 0.75]))
    assert rollout_rewards(client, key) == {2048: (1.0, 1), 4096: (1.0, 1), 8192: (0.5, 2)}
    assert client.hget(key, protocol.ROLLOUT_REWARD_VERSION) == b"8192"
    with pytest.raises(ValueError, match="reward_versions_kept=0"):
        DocumentWriter(client, config, 0, reward_versions_kept=0)


def test_concurrent_workers_lose_no_sample_of_kept_versions(redis_server):
    config = make_config(redis_server)
    key, kept, versions, workers = config.keys.rollout, 4, 40, 3
    errors: list[BaseException] = []

    def run(replica: int) -> None:
        client = redis_server.client()
        writer = DocumentWriter(client, config, replica, reward_versions_kept=kept)
        try:
            for step in range(versions):
                writer.report(batch(step * STEP, [float(replica), 1.0]))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    client = redis_server.client()
    rewards = rollout_rewards(client, key)
    mean = (sum(range(workers)) + workers) / (2 * workers)  # each worker adds (replica, 1.0)
    assert rewards == {step * STEP: (pytest.approx(mean), 2 * workers) for step in range(versions - kept, versions)}
    assert int(client.hget(key, "samples_generated")) == 2 * workers * versions


def test_stale_reward_fields_counts_the_version_being_added():
    fields = [b"reward_sum:10", b"reward_count:10", "reward_sum:30", "reward_count:30", b"reward_sum:20",
              b"reward_count:20", b"reward_count:x", b"reward", b"reward_version", b"samples_generated"]
    assert protocol.stale_reward_fields(fields, 40, keep=2) == ["reward_count:10", "reward_count:20", "reward_sum:10", "reward_sum:20"]
    assert protocol.stale_reward_fields(fields, 30, keep=2) == ["reward_count:10", "reward_sum:10"]
    assert protocol.stale_reward_fields(fields, 5, keep=3) == ["reward_count:5", "reward_sum:5"]  # only the one being added
    assert protocol.stale_reward_fields(fields, 5, keep=4) == []
