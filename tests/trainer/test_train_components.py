"""Small parts of the training entrypoint: the world-size check, the warm-up schedule, progress reporting."""

from __future__ import annotations

import io
import json
import time
import urllib.request

import pytest

from rljob_trainer.parallel import ParallelDims, WorldSizeMismatch
from rljob_trainer.progress import (
    NoOpProgress,
    RankZeroProgress,
    StepRecord,
    build_progress,
)
from rljob_trainer.optim import learning_rate
from train_harness import make_config


def test_parallel_dims_accepts_matching_world_and_prints_the_numbers_otherwise():
    ParallelDims(world_size=4, data_parallel=4).check()
    with pytest.raises(WorldSizeMismatch) as error:
        ParallelDims(world_size=3, data_parallel=2).check()
    message = str(error.value)
    assert "WORLD_SIZE=3" in message and "= 3 but the config's dataParallelSize is 2" in message
    assert error.value.code == message  # SystemExit with a message: exit status 1, message on stderr
    with pytest.raises(WorldSizeMismatch, match=r"tensorParallel=2 × pipelineParallel=1\) = 2 but .* is 1"):
        ParallelDims(world_size=4, data_parallel=1, tensor_parallel=2).check()
    with pytest.raises(WorldSizeMismatch, match="not supported yet"):
        ParallelDims(world_size=4, data_parallel=2, tensor_parallel=2).check()


def test_parallel_dims_shards_within_replica_groups_that_divide_the_data_parallel_size():
    hsdp = ParallelDims(world_size=8, data_parallel=8, strategy="fsdp", replicate=2)
    hsdp.check()
    assert hsdp.shard == 4
    assert ParallelDims(world_size=8, data_parallel=8, strategy="fsdp").shard == 8
    assert ParallelDims(world_size=8, data_parallel=8, strategy="ddp").shard == 1
    with pytest.raises(WorldSizeMismatch, match="replicate=3 with strategy fsdp does not fit the data-parallel size 8"):
        ParallelDims(world_size=8, data_parallel=8, strategy="fsdp", replicate=3).check()
    with pytest.raises(WorldSizeMismatch, match="replicate=2 with strategy ddp does not fit"):
        ParallelDims(world_size=8, data_parallel=8, strategy="ddp", replicate=2).check()


def test_learning_rate_warms_up_linearly():
    assert [learning_rate(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate(0, 3e-4, 0) == 3e-4


def test_rank_zero_progress_writes_hash_json_line_and_prometheus(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path, metrics_port=0)
    client = redis_server.client()
    out = io.StringIO()
    progress = RankZeroProgress(config, client, stdout=out)
    try:
        before = time.time()
        record = StepRecord(
            step=7, documents_seen=56, model_version=56, tokens_per_second=1234.5,
            metrics={"loss": 0.25, "staleness": 8.0}, stream={"redeliveries": 3},
        )
        progress.report(record)
        stored = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
        assert stored["step"] == "7" and stored["documents_seen"] == "56" and stored["model_version"] == "56"
        assert float(stored["tokens_per_second"]) == 1234.5
        assert json.loads(stored["metrics"]) == {"loss": 0.25, "staleness": 8.0}
        assert json.loads(stored["stream"]) == {"redeliveries": 3}
        assert before <= float(stored["updated_at"]) <= time.time()
        line = json.loads(out.getvalue())
        assert line["event"] == "step" and line["step"] == 7 and line["metrics"]["loss"] == 0.25

        scrape = urllib.request.urlopen(f"http://127.0.0.1:{progress.port}/metrics", timeout=10).read().decode()
        assert "rljob_trainer_documents_seen 56.0" in scrape
        assert 'rljob_trainer_metric{name="staleness"} 8.0' in scrape
        assert 'rljob_trainer_stream{counter="redeliveries"} 3.0' in scrape

        redis_server.stop()  # a Redis outage costs one progress write, never the training step
        progress.report(StepRecord(step=8, documents_seen=64, model_version=64, tokens_per_second=1.0))
        assert json.loads(out.getvalue().splitlines()[-1])["step"] == 8
    finally:
        progress.close()
        progress.close()


def test_other_ranks_report_nothing(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path, metrics_port=0)
    progress = build_progress(config, redis_server.client(), rank=1)
    assert isinstance(progress, NoOpProgress)
    progress.report(StepRecord(step=1, documents_seen=1, model_version=1, tokens_per_second=1.0))
    assert redis_server.client().exists(config.keys.progress) == 0
