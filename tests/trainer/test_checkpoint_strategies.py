"""Checkpoints resume across strategies and world sizes (issue 10 item 4, DESIGN §6): a checkpoint written by 4 FSDP2
ranks is resumed by 2 FSDP2 ranks, by 2 DDP ranks and by 1 rank; one written by DDP ranks is resumed by 2 FSDP2
ranks; one written by 4 ranks as HSDP (2 replica groups × 2 shards) by 2 FSDP2 ranks (issue 24 item 4: a topology
edit of a running job restarts the gang at the new size from its last checkpoint). Each resume continues as an
uninterrupted run on the same fixed stream, within floating-point tolerance.

Real torchrun gangs of gloo ranks and a real Redis, as in test_checkpoint_reshard.py: the 4-rank FSDP2 writer trains
5 steps of 4 documents (checkpoints at steps 2 and 4) and is SIGKILLed while blocked reading step 6, so the 4 entries
of step 5 are trained but pending under its consumers. Its checkpoint directory and its stream (Redis DUMP: entries,
consumer group, pending lists) are then copied into each reader, which resumes from step 4, is handed the 4 pending
entries (counted as redeliveries) and trains on. The 2-rank DDP reader trains to step 7 and is killed too; its step-6
checkpoint (written by DDP ranks) and stream are resumed by 2 FSDP2 ranks to step 8. The reference: one in-process
rank (DDP, no sharding) trained on the same 32 documents without interruption; its step-6 checkpoint and its export
at step 8 are what the readers must match. Tolerances: those of test_checkpoint_reshard's world-size change (the
documents of a step are summed in another order, and Adam's update amplifies the rounding over the steps).
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from portutil import free_port
from rljob_trainer.checkpoint import COMMIT_FILE, committed_checkpoints, step_dir
from rljob_trainer.train import run
from train_harness import (
    Torchrun,
    json_lines,
    make_config,
    make_documents,
    run_until_step_then_kill,
    wait_until,
    write_config,
    write_documents,
)

torch.set_num_threads(1)
PER_STEP, EVERY, STEPS = 4, 2, 8
DOCS = make_documents(STEPS * PER_STEP, seed=4)
RTOL, ATOL = 1e-4, 1e-5


pytestmark = pytest.mark.usefixtures("no_torchrun_env")


@dataclass(frozen=True)
class Killed:
    """A gang killed mid-run: its checkpoint root, its stream (Redis DUMP) and its per-step JSON lines."""

    checkpoints: Path
    stream: bytes
    lines: list[dict]


def config_for(redis, root: Path, processes: int, strategy: str, max_steps: int = STEPS, replicate: int = 1):
    return make_config(redis, root, processes=processes, documents_per_step=PER_STEP, max_steps=max_steps,
                       every_steps=EVERY, parallelism={"strategy": strategy, "replicate": replicate})


def kill_after(redis, tmp: Path, tag: str, processes: int, strategy: str, step: int, replicate: int = 1) -> Killed:
    """Train (from what ``tmp/tag`` and Redis hold) until ``step``, SIGKILL the gang, keep its checkpoints and stream."""
    client = redis.client()
    config = config_for(redis, tmp / tag, processes, strategy, replicate=replicate)
    trainer = run_until_step_then_kill(config, write_config(config, tmp / f"{tag}.json"), processes, step, redis, tmp, tag)
    # The killed ranks' blocked XREADGROUPs end once Redis sees their sockets close; only then is the stream final.
    wait_until(lambda: not any("b" in c["flags"] for c in client.client_list()), 30, "blocked clients gone")
    return Killed(tmp / tag, client.dump(config.keys.stream), json_lines(trainer))


def resume_from(redis, killed: Killed, root: Path, documents: list) -> None:
    """Give ``root`` the killed gang's checkpoints and Redis its stream (nothing else), then add ``documents``."""
    client = redis.client()
    client.flushall()
    config = config_for(redis, root, 1, "ddp")
    client.restore(config.keys.stream, 0, killed.stream)
    shutil.copytree(killed.checkpoints, root)
    write_documents(client, config, documents)


def checkpoint_weights(directory: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, whichever ranks and strategy wrote it."""
    converted = tmp / f"{directory.name}.pt"
    dcp_to_torch_save(directory, converted)
    return torch.load(converted, weights_only=False)["model"]


def commits(root: Path) -> list[tuple[int, int]]:
    """(step, world size that wrote it) of every committed checkpoint under ``root``."""
    return [(c["step"], c["world_size"]) for c in (json.loads((p / COMMIT_FILE).read_text()) for p in committed_checkpoints(root))]


def progress(lines: list[dict]) -> list[tuple[int, int, int]]:
    return [(x["step"], x["documents_seen"], x["stream"]["redeliveries"]) for x in lines]


def assert_close_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)


# --- the shared runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("strategies")


@pytest.fixture(scope="module")
def reference(module_redis_server, tmp) -> dict[int, dict[str, torch.Tensor]]:
    """{6: weights of the uninterrupted run's step-6 checkpoint, 8: its export at step 8} (one in-process rank, DDP)."""
    client = module_redis_server.client()
    client.flushall()
    config = config_for(module_redis_server, tmp / "reference", 1, "ddp")
    write_documents(client, config, DOCS)
    result = run(config, client=client, stdout=io.StringIO())
    assert (result.step, result.documents_seen) == (STEPS, STEPS * PER_STEP)
    return {6: checkpoint_weights(step_dir(tmp / "reference", 6), tmp),
            8: load_file(Path(result.export_dir) / "model.safetensors")}


@pytest.fixture(scope="module")
def fsdp4(module_redis_server, tmp) -> Killed:
    """4 FSDP2 ranks, 5 steps (checkpoints at 2 and 4), killed while reading step 6."""
    client = module_redis_server.client()
    client.flushall()
    write_documents(client, config_for(module_redis_server, tmp / "fsdp4", 4, "fsdp"), DOCS[: 5 * PER_STEP])
    killed = kill_after(module_redis_server, tmp, "fsdp4", 4, "fsdp", 5)
    assert progress(killed.lines) == [(s, s * PER_STEP, 0) for s in range(1, 6)]
    assert commits(killed.checkpoints) == [(2, 4), (4, 4)]
    return killed


@pytest.fixture(scope="module")
def hsdp4(module_redis_server, tmp) -> Killed:
    """4 ranks as HSDP (2 replica groups × 2 shards), 5 steps (checkpoints at 2 and 4), killed while reading step 6."""
    client = module_redis_server.client()
    client.flushall()
    config = config_for(module_redis_server, tmp / "hsdp4", 4, "fsdp", replicate=2)
    write_documents(client, config, DOCS[: 5 * PER_STEP])
    killed = kill_after(module_redis_server, tmp, "hsdp4", 4, "fsdp", 5, replicate=2)
    assert progress(killed.lines) == [(s, s * PER_STEP, 0) for s in range(1, 6)]
    assert commits(killed.checkpoints) == [(2, 4), (4, 4)]
    return killed


@pytest.fixture(scope="module")
def ddp2(module_redis_server, tmp, fsdp4) -> Killed:
    """2 DDP ranks resume the FSDP2 checkpoint of step 4 and train to step 7 (checkpoint at 6), then are killed."""
    resume_from(module_redis_server, fsdp4, tmp / "ddp2", DOCS[5 * PER_STEP : 7 * PER_STEP])
    return kill_after(module_redis_server, tmp, "ddp2", 2, "ddp", 7)


# --- the resumes ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("writer", ["fsdp4", "hsdp4"])
def test_a_four_rank_checkpoint_resumes_on_two_fsdp_ranks(module_redis_server, tmp, writer, reference, request):
    """FSDP2 over 4 ranks, or HSDP over 2 × 2 (each replica group writes the same shards; DCP saves them once)."""
    killed, tag = request.getfixturevalue(writer), f"{writer}-to-fsdp2"
    resume_from(module_redis_server, killed, tmp / tag, DOCS[5 * PER_STEP : 6 * PER_STEP])
    config = config_for(module_redis_server, tmp / tag, 2, "fsdp", max_steps=6)
    trainer = Torchrun(write_config(config, tmp / f"{tag}.json"), 2, free_port(), module_redis_server.password, tmp,
                       tag)
    assert trainer.wait(240) == 0, trainer.logs()
    trainer.kill()
    # Resumed at step 4: the 4 pending entries of step 5 were spread over the 2 ranks and re-read.
    assert progress(json_lines(trainer)) == [(5, 20, 4), (6, 24, 4)]
    assert commits(tmp / tag) == [(2, 4), (4, 4), (6, 2)]
    assert module_redis_server.client().xinfo_groups(config.keys.stream)[0]["pending"] == 0
    assert_close_weights(load_file(tmp / tag / "export" / "model.safetensors"), reference[6])


def test_fsdp4_checkpoint_resumes_on_two_ddp_ranks(tmp, ddp2, reference):
    assert progress(ddp2.lines) == [(5, 20, 4), (6, 24, 4), (7, 28, 4)]
    assert commits(ddp2.checkpoints) == [(2, 4), (4, 4), (6, 2)]
    assert_close_weights(checkpoint_weights(step_dir(ddp2.checkpoints, 6), tmp), reference[6])


def test_fsdp4_checkpoint_resumes_on_one_rank(module_redis_server, tmp, fsdp4, reference):
    resume_from(module_redis_server, fsdp4, tmp / "one", DOCS[5 * PER_STEP : 6 * PER_STEP])
    config = config_for(module_redis_server, tmp / "one", 1, "fsdp", max_steps=6)  # a 1-rank mesh: the default strategy
    out = io.StringIO()
    result = run(config, client=module_redis_server.client(), stdout=out)
    assert (result.step, result.documents_seen) == (6, 24)
    assert progress([json.loads(line) for line in out.getvalue().splitlines()]) == [(5, 20, 4), (6, 24, 4)]
    assert commits(tmp / "one") == [(2, 4), (4, 4), (6, 1)]
    assert_close_weights(load_file(Path(result.export_dir) / "model.safetensors"), reference[6])


def test_ddp_checkpoint_resumes_on_two_fsdp_ranks(module_redis_server, tmp, ddp2, reference):
    resume_from(module_redis_server, ddp2, tmp / "ddp-to-fsdp2", DOCS[7 * PER_STEP :])
    config = config_for(module_redis_server, tmp / "ddp-to-fsdp2", 2, "fsdp")
    trainer = Torchrun(write_config(config, tmp / "ddp-to-fsdp2.json"), 2, free_port(), module_redis_server.password,
                       tmp, "ddp-to-fsdp2")
    assert trainer.wait(240) == 0, trainer.logs()
    trainer.kill()
    # Resumed at the DDP ranks' step 6: their 4 trained, uncheckpointed entries of step 7 are re-read.
    assert progress(json_lines(trainer)) == [(7, 28, 4), (8, 32, 4)]
    assert commits(tmp / "ddp-to-fsdp2") == [(2, 4), (4, 4), (6, 2), (8, 2)]
    assert module_redis_server.client().xinfo_groups(config.keys.stream)[0]["pending"] == 0
    assert_close_weights(load_file(tmp / "ddp-to-fsdp2" / "export" / "model.safetensors"), reference[8])
