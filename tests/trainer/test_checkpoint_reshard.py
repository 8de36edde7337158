"""Resuming after a kill matches an uninterrupted run: on one rank exactly the same documents in the same
order (DP=1, so the comparison is tight), and across a world-size change (a 2-rank checkpoint resumed on 1
rank: DCP reshards, the vanished consumer's pending entries are claimed) within floating-point tolerance,
since the documents of a step are then summed in another order."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rljob_trainer.checkpoint import COMMIT_FILE, committed_checkpoints
from rljob_trainer.train import run
from train_harness import (
    make_config,
    make_documents,
    run_until_step_then_kill,
    wait_until,
    write_config,
    write_documents,
)

torch.set_num_threads(1)
STEPS, PER_STEP, KILL_AFTER = 6, 4, 5


pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def uninterrupted_weights(redis_server, tmp_path, docs) -> dict[str, torch.Tensor]:
    """Final weights of one in-process rank trained on ``docs`` without interruption (Redis flushed first)."""
    client = redis_server.client()
    client.flushall()
    config = make_config(redis_server, tmp_path / "reference", processes=1, max_steps=STEPS, documents_per_step=PER_STEP)
    write_documents(client, config, docs)
    result = run(config, client=client, stdout=io.StringIO())
    assert result.step == STEPS
    return load_file(Path(result.export_dir) / "model.safetensors")


def kill_then_resume_in_process(redis_server, tmp_path, docs, killed_processes):
    """Train on ``killed_processes`` torchrun ranks until step 5 and SIGKILL them (checkpoint at step 4), then
    resume on one in-process rank to step 6; return (final weights, resumed run's JSON lines, its config)."""
    client = redis_server.client()
    killed = make_config(
        redis_server, tmp_path / "ckpt", processes=killed_processes, max_steps=STEPS, documents_per_step=PER_STEP
    )
    write_documents(client, killed, docs[: KILL_AFTER * PER_STEP])
    run_until_step_then_kill(killed, write_config(killed, tmp_path / "killed.json"), killed_processes, KILL_AFTER,
                             redis_server, tmp_path, "killed")
    wait_until(lambda: not any("b" in c["flags"] for c in client.client_list()), 30, "blocked clients gone")
    write_documents(client, killed, docs[KILL_AFTER * PER_STEP :])
    resumed = make_config(redis_server, tmp_path / "ckpt", processes=1, max_steps=STEPS, documents_per_step=PER_STEP)
    out = io.StringIO()
    result = run(resumed, client=client, stdout=out)
    assert (result.step, result.documents_seen) == (STEPS, STEPS * PER_STEP)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    return load_file(Path(result.export_dir) / "model.safetensors"), lines, resumed


def test_one_rank_resume_matches_uninterrupted_run(redis_server, tmp_path):
    docs = make_documents(STEPS * PER_STEP, seed=2)
    resumed, lines, _ = kill_then_resume_in_process(redis_server, tmp_path, docs, killed_processes=1)
    assert [(x["step"], x["documents_seen"], x["stream"]["redeliveries"]) for x in lines] == [(5, 20, 4), (6, 24, 4)]
    reference = uninterrupted_weights(redis_server, tmp_path, docs)
    assert resumed.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], rtol=1e-6, atol=1e-7, msg=name)


def test_two_rank_checkpoint_resumes_on_one_rank(redis_server, tmp_path):
    docs = make_documents(STEPS * PER_STEP, seed=3)
    resumed, lines, config = kill_then_resume_in_process(redis_server, tmp_path, docs, killed_processes=2)
    # Rank 0 re-read its own 2 pending entries of step 5 and claimed the 2 of the vanished consumer 1.
    assert [(x["step"], x["documents_seen"], x["stream"]["redeliveries"]) for x in lines] == [(5, 20, 4), (6, 24, 4)]
    client = redis_server.client()
    group = client.xinfo_groups(config.keys.stream)[0]
    assert group["pending"] == 0
    assert [c["name"] for c in client.xinfo_consumers(config.keys.stream, config.keys.group)] == [b"fast_llm_consumer_0"]
    commits = [json.loads((p / COMMIT_FILE).read_text()) for p in committed_checkpoints(tmp_path / "ckpt")]
    assert [(c["step"], c["world_size"]) for c in commits] == [(2, 2), (4, 2), (6, 1)]

    reference = uninterrupted_weights(redis_server, tmp_path, docs)
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
