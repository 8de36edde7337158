"""Experiment trackers of global rank 0 (rljob_trainer.trackers) in real trainer runs: TensorBoard event files read
back with TensorBoard's own EventAccumulator, MLflow through its file store, Weights & Biases through an offline run's
.wandb file (read by the wandb package's own inspector), and trackers whose package is missing or whose server cannot
be reached, which must leave training alone."""

from __future__ import annotations

import io
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from portutil import free_port
from rljob_trainer.checkpoint import committed_checkpoints
from rljob_trainer.trackers import step_scalars
from rljob_trainer.train import run
from train_harness import Torchrun, json_lines, make_config, make_documents, write_config, write_documents

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def expected_scalars(lines: list[dict]) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} the trackers must hold for the trainer's JSON lines (the per-step records)."""
    out = {}
    for line in lines:
        record = {k: line[k] for k in ("step", "documents_seen", "model_version", "tokens_per_second")}
        out[line["step"]] = {
            "train/" + name: float(v) for name, v in line["metrics"].items()
        } | {"stream/" + name: float(v) for name, v in line["stream"].items()} | {
            f"progress/{name}": float(record[name]) for name in ("tokens_per_second", "documents_seen", "model_version")
        }
    return out


def run_lines(config, client) -> list[dict]:
    """The JSON lines (one per step) of an in-process trainer run of ``config``."""
    out = io.StringIO()
    run(config, client=client, stdout=out)
    return [json.loads(x) for x in out.getvalue().splitlines()]


def read_event_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} of every scalar in the event files under ``log_dir`` (purged steps left out, as
    TensorBoard shows them)."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in out.setdefault(event.step, {}), f"{tag} twice at step {event.step}"
            out[event.step][tag] = event.value
    return out


def assert_same_scalars(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], *, float32: bool):
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step
        for tag, value in want[step].items():
            expected = float(np.float32(value)) if float32 else value  # event files hold float32 simple values
            if math.isnan(expected):
                assert math.isnan(got[step][tag]), (step, tag, got[step][tag])
            else:
                assert got[step][tag] == expected, (step, tag, got[step][tag], expected)


def test_two_rank_run_writes_event_files_of_every_step_from_rank_zero_only(redis_server, tmp_path):
    board = tmp_path / "tensorboard"
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=3,
                         tensorboard=board)
    write_documents(redis_server.client(), config, make_documents(12, seed=0))
    trainer = Torchrun(write_config(config, tmp_path / "config.json"), 2, free_port(), redis_server.password, tmp_path,
                       "run")
    assert trainer.wait(240) == 0, trainer.logs()
    trainer.kill()

    lines = json_lines(trainer)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert len(list(board.glob("events.out.tfevents.*"))) == 1  # global rank 0 alone writes
    want = expected_scalars(lines)
    assert {"train/loss", "train/train_samples_reward", "train/staleness", "train/weight_sync_time_ms",
            "stream/dead_lettered", "progress/tokens_per_second"} <= want[1].keys()
    assert_same_scalars(read_event_scalars(board), want, float32=True)


def test_a_resumed_attempt_hides_the_steps_it_trains_again(redis_server, client, tmp_path):
    """Attempt 1 logs steps 1-3; attempt 2 starts from attempt 1's step-2 checkpoint (initFrom) on other documents:
    TensorBoard shows steps 1-2 of attempt 1 and step 3 of attempt 2 only (purge_step)."""
    board = tmp_path / "tensorboard"
    first = make_config(redis_server, tmp_path / "first", processes=1, documents_per_step=4, max_steps=3,
                        every_steps=2, tensorboard=board)
    write_documents(client, first, make_documents(12, seed=1))
    first_lines = run_lines(first, client)
    (step2,) = [p for p in committed_checkpoints(tmp_path / "first") if p.name == "step-00000002"]

    client.flushall()
    second = make_config(redis_server, tmp_path / "second", processes=1, documents_per_step=4, max_steps=3,
                         every_steps=2, tensorboard=board, init_from=str(step2))
    write_documents(client, second, make_documents(4, seed=2))
    second_lines = run_lines(second, client)
    assert [line["step"] for line in second_lines] == [3]
    assert second_lines[0]["metrics"]["train_samples_reward"] != first_lines[2]["metrics"]["train_samples_reward"]

    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    assert_same_scalars(read_event_scalars(board), expected_scalars(first_lines[:2] + second_lines), float32=True)


def test_mlflow_file_store_gets_every_step_of_a_finished_run(redis_server, client, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store unless told
    monkeypatch.setenv("RLJOB_ATTEMPT", "2")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=3)
    write_documents(client, config, make_documents(12, seed=3))
    lines = run_lines(config, client)

    tracking = mlflow.MlflowClient(f"file:{tmp_path / 'mlruns'}")
    experiment = tracking.get_experiment_by_name("rljob-ns-job")
    (found,) = tracking.search_runs([experiment.experiment_id])
    assert (found.info.run_name, found.info.status) == ("job-attempt-2", "FINISHED")
    assert found.data.tags["rljob.job"] == "job" and found.data.tags["rljob.attempt"] == "2"
    got: dict[int, dict[str, float]] = {}
    for key in found.data.metrics:
        for point in tracking.get_metric_history(found.info.run_id, key):
            got.setdefault(point.step, {})[key] = point.value
    assert_same_scalars(got, expected_scalars(lines), float32=False)


def read_wandb_records(wandb_dir: Path) -> list[dict]:
    """The records of the one offline run's .wandb file under ``wandb_dir``, as ``wandb leet inspect --json`` prints
    them (the package's own reader of its transaction log: wandb-core; W&B 0.31 has no Python reader)."""
    log_files = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(log_files) == 1, sorted(str(p.relative_to(wandb_dir)) for p in wandb_dir.rglob("*"))
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_files[0])],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B on (a dummy key) in offline mode, writing under ``tmp_path``; its wandb-core service is stopped after."""
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 2 + "01234567")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb_dir
    wandb.teardown()


def test_wandb_offline_run_gets_every_step_and_finishes(redis_server, client, tmp_path, monkeypatch, wandb_offline):
    monkeypatch.setenv("WANDB_PROJECT", "rl-tests")
    monkeypatch.setenv("RLJOB_ATTEMPT", "3")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=3)
    write_documents(client, config, make_documents(12, seed=6))
    lines = run_lines(config, client)
    assert [line["step"] for line in lines] == [1, 2, 3]

    records = read_wandb_records(wandb_offline)
    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run_record["project"], run_record["display_name"], run_record["run_group"], run_record["job_type"]) == (
        "rl-tests", "job-attempt-3", "ns/job", "train")
    assert run_record["tags"] == ["rljob.job:job", "rljob.namespace:ns", "rljob.attempt:3"], run_record
    logged_config: dict = {}
    for record in records:
        if record["type"] in ("run", "config"):
            logged_config |= record[record["type"]]["config"]["update"]
    logged_config.pop("_wandb")
    assert logged_config == config.spec.model_dump(mode="json", by_alias=True)
    got: dict[int, dict[str, float]] = {}
    for record in (r["history"] for r in records if r["type"] == "history"):
        step = record["step"]["num"]
        assert step not in got, f"step {step} twice"
        assert record["item"].pop("_step") == step
        got[step] = {tag: float(value) for tag, value in record["item"].items() if not tag.startswith("_")}
    assert_same_scalars(got, expected_scalars(lines), float32=False)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]  # finished, once


def test_trackers_whose_package_is_missing_are_named_and_training_goes_on(redis_server, client, tmp_path, monkeypatch,
                                                                        caplog):
    """W&B and MLflow env set, TensorBoard configured, none of the three importable (sys.modules entries of None make
    the import fail, as in an image without the package): the run trains to the end and says why each is off."""
    for module in ("wandb", "mlflow", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.invalid:5000")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=2,
                         tensorboard=tmp_path / "tensorboard")
    write_documents(client, config, make_documents(8, seed=4))
    with caplog.at_level(logging.WARNING, logger="rljob_trainer.trackers"):
        result = run(config, client=client, stdout=io.StringIO())
    assert (result.step, result.documents_seen) == (2, 8)
    messages = [r.getMessage() for r in caplog.records if r.name == "rljob_trainer.trackers"]
    assert len(messages) == 3, messages
    assert messages[0].startswith("trackers: spec.trainer.tensorboard is set but torch.utils.tensorboard cannot be "
                                  "imported in this image")
    assert messages[1].startswith("trackers: WANDB_API_KEY is set but the wandb package cannot be imported in this "
                                  "image")
    assert messages[2].startswith("trackers: MLFLOW_TRACKING_URI is set but the mlflow package cannot be imported in "
                                  "this image")
    assert "training goes on without MLflow" in messages[2]
    assert not (tmp_path / "tensorboard").exists()


def test_an_unreachable_tracking_server_leaves_training_alone(redis_server, client, tmp_path, monkeypatch, caplog):
    """MLflow installed, its server refusing connections (a port nothing listens on): the run trains every step and
    the tracker's failure to start is one warning."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=2)
    write_documents(client, config, make_documents(8, seed=5))
    with caplog.at_level(logging.WARNING, logger="rljob_trainer.trackers"):
        result = run(config, client=client, stdout=io.StringIO())
    assert (result.step, result.documents_seen) == (2, 8)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "rljob_trainer.trackers"]
    assert message.startswith("trackers: MLflow (http://127.0.0.1:") and "could not start, not logging to it" in message


def test_step_scalars_name_every_part_of_the_record():
    from rljob_trainer.step_record import StepRecord

    record = StepRecord(step=7, documents_seen=28, model_version=28, tokens_per_second=12.5,
                        metrics={"loss": 0.25, "sampler_mismatch_ratio": float("nan")}, stream={"dead_lettered": 1})
    scalars = step_scalars(record)
    assert math.isnan(scalars.pop("train/sampler_mismatch_ratio"))
    assert scalars == {"train/loss": 0.25, "stream/dead_lettered": 1.0, "progress/tokens_per_second": 12.5,
                       "progress/documents_seen": 28.0, "progress/model_version": 28.0}
