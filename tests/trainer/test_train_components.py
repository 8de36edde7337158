"""Small parts of the training entrypoint: the world-size check, the learning-rate schedules, progress reporting."""

from __future__ import annotations

import io
import json
import math
import time
import urllib.request

import pytest
import torch

from rljob_trainer.parallel import ParallelDims, WorldSizeMismatch
from rljob_trainer.progress_report import (
    NoOpProgress,
    RankZeroProgress,
    StepRecord,
    build_progress,
)
from rljob_api.spec import OptimizerSpec
from rljob_trainer.optim import learning_rate, step_learning_rate
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


# Warm-up 2 of 10 steps, base 1, floor 0.1: progress p = (step - 2) / 8 after the warm-up.
#   linear: 0.1 + 0.9 (1 - p);  cosine: 0.1 + 0.9 (1 + cos(pi p)) / 2
DECAY_BY_HAND = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125],
    "cosine": [0.5, 1.0, 1.0] + [0.1 + 0.9 * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(1, 8)],
}


@pytest.mark.parametrize("schedule", DECAY_BY_HAND)
def test_learning_rate_decays_after_the_warm_up_by_hand(schedule):
    rates = [learning_rate(s, 1.0, 2, schedule=schedule, total_steps=10, floor=0.1) for s in range(10)]
    assert rates == pytest.approx(DECAY_BY_HAND[schedule], abs=1e-12)
    assert DECAY_BY_HAND["cosine"][6] == pytest.approx(0.55, abs=1e-12)  # half-way: half-way between base and floor
    beyond = learning_rate(12, 1.0, 2, schedule=schedule, total_steps=10, floor=0.1)
    assert beyond == (1.0 if schedule == "constant" else pytest.approx(0.1))  # a raised maxSteps never goes below


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_learning_rate_decay_equals_torchs_schedulers(schedule):
    """After the warm-up, the same rates as torch's LinearLR (end factor floor/base) and CosineAnnealingLR (eta_min
    = floor) stepped once per update."""
    base, floor, warmup, total = 3e-4, 2e-5, 3, 17
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = (torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, floor / base, total_iters=total - warmup)
                 if schedule == "linear" else
                 torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=floor))
    expected = []
    for _ in range(warmup, total):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    rates = [learning_rate(s, base, warmup, schedule=schedule, total_steps=total, floor=floor)
             for s in range(warmup, total)]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_learning_rate_schedule_reads_the_optimizer_spec_and_checks_its_arguments():
    spec = OptimizerSpec(learning_rate=1.0, warmup_steps=2, schedule="linear", min_learning_rate=0.1)
    assert [step_learning_rate(s, spec, 10) for s in range(10)] == pytest.approx(DECAY_BY_HAND["linear"], abs=1e-12)
    with pytest.raises(ValueError, match="the cosine schedule needs total_steps"):
        learning_rate(5, 1.0, 0, schedule="cosine")
    with pytest.raises(ValueError, match="floor = 2 must not exceed base = 1"):
        learning_rate(5, 1.0, 0, schedule="linear", total_steps=10, floor=2.0)
    with pytest.raises(ValueError, match="schedule must be constant, linear or cosine, got 'step'"):
        learning_rate(5, 1.0, 0, schedule="step")  # type: ignore[arg-type]


def test_rank_zero_progress_writes_hash_json_line_and_prometheus(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path, metrics_port=0)
    client = redis_server.client()
    out = io.StringIO()
    progress = RankZeroProgress(config, client, stdout=out)
    try:
        before = time.time()
        record = StepRecord(
            step=7, documents_seen=56, model_version=56, tokens_per_second=1234.5,
            metrics={"loss": 0.25, "staleness": 8.0, "weight_sync_time_ms": 12.5}, stream={"redeliveries": 3},
            weight_sync_layout="packed",
        )
        progress.report(record)
        progress.flush()
        stored = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
        assert stored["step"] == "7" and stored["documents_seen"] == "56" and stored["model_version"] == "56"
        assert float(stored["tokens_per_second"]) == 1234.5
        assert json.loads(stored["metrics"]) == {"loss": 0.25, "staleness": 8.0, "weight_sync_time_ms": 12.5}
        assert json.loads(stored["stream"]) == {"redeliveries": 3}
        assert before <= float(stored["updated_at"]) <= time.time()
        line = json.loads(out.getvalue())
        assert line["event"] == "step" and line["step"] == 7 and line["metrics"]["loss"] == 0.25
        assert line["weight_sync_layout"] == "packed"

        scrape = urllib.request.urlopen(f"http://127.0.0.1:{progress.port}/metrics", timeout=10).read().decode()
        assert "rljob_trainer_documents_seen 56.0" in scrape
        assert 'rljob_trainer_metric{name="staleness"} 8.0' in scrape
        assert 'rljob_trainer_stream{counter="redeliveries"} 3.0' in scrape
        assert 'rljob_trainer_weight_sync_time_ms{layout="packed"} 12.5' in scrape

        # A step whose publication ran in the background is reported once it ended, with its wall time and layout;
        # one whose publication raised is not reported at all, and the error comes back to the trainer.
        from concurrent.futures import Future

        from rljob_trainer.fence import Fenced
        from rljob_trainer.weight_publisher import Publication

        published: Future = Future()
        progress.report(StepRecord(step=8, documents_seen=64, model_version=64, tokens_per_second=1.0,
                                   metrics={"weight_sync_time_ms": 0.1}), published)
        time.sleep(0.3)
        assert client.hget(config.keys.progress, "step") == b"7"  # waits for its publication
        published.set_result(Publication(30.0, 0.0, 1, {}, "per-tensor"))
        progress.flush()
        assert client.hget(config.keys.progress, "step") == b"8"
        line = json.loads(out.getvalue().splitlines()[-1])
        assert line["metrics"] == {"weight_sync_time_ms": 0.1, "weight_sync_overlapped_time_ms": 30.0}
        assert line["weight_sync_layout"] == "per-tensor"
        failed: Future = Future()
        failed.set_exception(Fenced(1, ":2"))
        progress.report(StepRecord(step=9, documents_seen=72, model_version=72, tokens_per_second=1.0), failed)
        with pytest.raises(Fenced):
            progress.flush()
        assert client.hget(config.keys.progress, "step") == b"8" and json.loads(out.getvalue().splitlines()[-1])["step"] == 8

        redis_server.stop()  # a Redis outage costs one progress write, never the training step
        progress.report(StepRecord(step=10, documents_seen=80, model_version=80, tokens_per_second=1.0))
        progress.flush()
        assert json.loads(out.getvalue().splitlines()[-1])["step"] == 10
    finally:
        progress.close()
        progress.close()


def test_rank_zero_progress_reports_off_the_step_in_order_and_raises_a_failure_at_the_next_call(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path, metrics_port=0)
    out = io.StringIO()
    progress = RankZeroProgress(config, redis_server.client(), stdout=out)
    try:
        for step in range(1, 6):
            progress.report(StepRecord(step=step, documents_seen=8 * step, model_version=8 * step, tokens_per_second=1.0))
        progress.flush()
        assert [json.loads(line)["step"] for line in out.getvalue().splitlines()] == [1, 2, 3, 4, 5]
        assert redis_server.client().hget(config.keys.progress, "step") == b"5"
        out.close()  # the next report's line cannot be written: its error surfaces, in the trainer's thread
        progress.report(StepRecord(step=6, documents_seen=48, model_version=48, tokens_per_second=1.0))
        with pytest.raises(ValueError, match="I/O operation on closed file"):
            progress.flush()
    finally:
        progress.close()


def test_other_ranks_report_nothing(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path, metrics_port=0)
    progress = build_progress(config, redis_server.client(), rank=1)
    assert isinstance(progress, NoOpProgress)
    progress.report(StepRecord(step=1, documents_seen=1, model_version=1, tokens_per_second=1.0))
    assert redis_server.client().exists(config.keys.progress) == 0
