"""Progress hashes: parsing (tolerant of bad fields) and fetching from a real Redis with a password."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from rljob_api.config import RedisConnection

from rljob_operator import progress, render

from operator_helpers import make_job


def test_parse_reads_trainer_fields_and_the_newest_rollout_version():
    parsed = progress.parse(
        {b"step": b"7", b"documents_seen": b"448", b"model_version": b"448", b"tokens_per_second": b"812.5",
         b"metrics": json.dumps({"train_samples_reward": 0.25, "staleness": 64, "bad": "x", "nan": float("nan")}).encode(),
         b"updated_at": b"1700000000.0"},
        {"reward_sum:384": "12.0", "reward_count:384": "16", "reward_sum:448": "3.0", "reward_count:448": "4",
         "reward_count:512": "0", "reward_sum:512": "0", "samples_generated": "120"},
    )
    assert (parsed.step, parsed.documents_seen, parsed.model_version) == (7, 448, 448)
    assert parsed.tokens_per_second == 812.5
    assert parsed.metrics == {"train_samples_reward": 0.25, "staleness": 64.0}
    assert (parsed.rollout_reward, parsed.rollout_model_version) == (0.75, 448)


def test_parse_skips_what_it_cannot_read_and_keeps_big_integers_exact():
    parsed = progress.parse({"step": "abc", "documents_seen": str(2**60 + 1), "metrics": "{not json"},
                            {"reward_count:x": "3", "reward_sum:1": "inf", "reward_count:1": "2"})
    assert parsed.step is None and parsed.documents_seen == 2**60 + 1
    assert parsed.metrics == {} and parsed.rollout_reward is None
    assert progress.parse({}, {}).status_fields() == {}


def test_fetch_from_a_real_redis(redis_server):
    job = make_job(redis={"mode": "external", "url": redis_server.url})
    keys = render.job_config(job).keys
    writer = redis_server.client()
    writer.hset(keys.progress, mapping={"step": 3, "documents_seen": 192, "model_version": 192,
                                        "metrics": json.dumps({"kl_new_old": 0.01})})
    writer.hincrbyfloat(keys.rollout, "reward_sum:128", 5.0)
    writer.hincrby(keys.rollout, "reward_count:128", 8)

    async def go():
        connection = RedisConnection(host=redis_server.host, port=redis_server.port)
        good = progress.connect(connection, redis_server.password)
        wrong = progress.connect(connection, "not-the-password")
        try:
            fetched = await progress.fetch(good, keys)
            with pytest.raises(redis.RedisError):
                await progress.fetch(wrong, keys)
        finally:
            await good.aclose()
            await wrong.aclose()
        return fetched

    fetched = asyncio.run(go())
    assert fetched.status_fields() == {
        "step": 3, "documents_seen": 192, "model_version": 192, "rollout_reward": 0.625,
        "rollout_model_version": 128, "last_metrics": {"kl_new_old": 0.01},
    }
