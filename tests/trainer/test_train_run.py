"""The training entrypoint end to end: torchrun with 2 gloo ranks fed by a real Redis, against hand
references (first-step loss, metric values), a 1-rank in-process run on the same documents, the world-size
check and the no-data timeout."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from portutil import free_port
from rljob_trainer.checkpoint import COMMIT_FILE, committed_checkpoints
from rljob_trainer.metrics_registry import (CHECKPOINT_BLOCKING, CHECKPOINT_SAVE, FORWARD_BACKWARD, STEP_OTHER,
                                            STEP_PHASES, STEP_TIME, WEIGHT_SYNC, WEIGHT_SYNC_OVERLAPPED,
                                            WEIGHT_SYNC_WAIT)
from rljob_wire.model import DigitTokenizer, build_model
from rljob_trainer.stream.reader import DataTimeout
from rljob_trainer.train import run
from train_harness import (
    Torchrun,
    WeightReceiver,
    json_lines,
    make_config,
    make_documents,
    read_events,
    wait_until,
    write_config,
    write_documents,
)

torch.set_num_threads(1)


pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def reference_first_step(config, docs):
    """Loss and metrics of the untrained model's first step on ``docs``, one document at a time in float64:
    log p(tokens[t] | tokens[<t]) at the sampling temperature, the loss of DESIGN §4 (GRPO: token-level, over
    the step's labelled tokens; GSPO in Fast-LLM's form: each labelled token of d contributes
    -min(R_d A_d, clip(R_d) A_d), over the step's documents), and the document-weighted means of the new
    log-probabilities and of the entropy."""
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, config.spec.trainer.seed).double()
    temperature = config.spec.rollout.sampling.temperature
    low, high = config.spec.algorithm.resolved_epsilons()
    total, labels, new_means, entropy_means = 0.0, 0, [], []
    for doc in docs:
        ids = torch.tensor(doc.tokens)[None]
        with torch.no_grad():
            log_p = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / temperature, -1)  # scores tokens 1..T-1
        new = log_p.gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor(doc.label_mask()[1:])
        log_ratio = new - torch.tensor(doc.old_log_probabilities[1:], dtype=torch.float64)
        if config.spec.algorithm.loss == "grpo":
            ratio = log_ratio.exp()[mask]
        else:
            ratio = log_ratio[mask].mean().exp().expand(int(mask.sum()))
        total += -torch.minimum(ratio * doc.advantage, ratio.clamp(1 - low, 1 + high) * doc.advantage).sum().item()
        labels += int(mask.sum())
        new_means.append(new[mask].mean().item())
        entropy_means.append(-(log_p.exp() * log_p).sum(-1)[mask].mean().item())
    normaliser = labels if config.spec.algorithm.loss == "grpo" else len(docs)
    return {
        "loss": total / normaliser,
        "new_logprobs": sum(new_means) / len(docs),
        "entropy": sum(entropy_means) / len(docs),
    }


def train_two_ranks_with_a_member(redis_server, config, tmp_path: Path) -> tuple[WeightReceiver, Torchrun]:
    """Train ``config`` to its end under torchrun with 2 ranks while a live rollout member (:class:`WeightReceiver`)
    receives the full weights of every update; returns both once the member saw training_finished."""
    receiver = WeightReceiver(config, redis_server.client())
    try:
        trainer = Torchrun(write_config(config, tmp_path / "config.json"), 2, free_port(), redis_server.password, tmp_path, "run")
        assert trainer.wait(240) == 0, trainer.logs()
        trainer.kill()
        wait_until(lambda: receiver.finished or receiver.error, 30, "training_finished at the receiver")
    finally:
        receiver.stop()
    assert receiver.error is None, receiver.error
    return receiver, trainer


def test_two_rank_run_trains_checkpoints_reports_and_matches_one_rank(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=3, every_steps=2)
    client = redis_server.client()
    docs = make_documents(12, seed=0)
    ids = write_documents(client, config, docs)
    receiver, trainer = train_two_ranks_with_a_member(redis_server, config, tmp_path)
    lines = json_lines(trainer)
    assert [(x["step"], x["documents_seen"], x["model_version"]) for x in lines] == [(1, 4, 4), (2, 8, 8), (3, 12, 12)]
    for k, line in enumerate(lines):
        step_docs = docs[4 * k : 4 * k + 4]  # each rank reads exactly 2 per step, so step k gets entries 4k..4k+3
        m = line["metrics"]
        assert m["num_tokens"] == 16  # 4 documents x 4 labelled completion tokens
        assert m["staleness"] == m["max_staleness"] == m["min_staleness"] == 4 * k  # documents_seen before - 0
        rewards = [d.reward for d in step_docs]
        assert m["train_samples_reward"] == pytest.approx(sum(rewards) / 4, rel=1e-6)
        assert m["max_train_samples_reward"] == pytest.approx(max(rewards), rel=1e-6)
        assert m["min_train_samples_reward"] == pytest.approx(min(rewards), rel=1e-6)
        assert m["advantage"] == pytest.approx(sum(d.advantage for d in step_docs) / 4, rel=1e-5, abs=1e-6)
        assert line["stream"]["redeliveries"] == 0 and line["tokens_per_second"] > 0
        assert m[WEIGHT_SYNC] > 0  # each step's publication (rank 0, ms)
        # The step's phases (rank 0, ms) partition its wall time; the forward/backward always takes some.
        assert m[FORWARD_BACKWARD] > 0 and all(m[name] >= 0 for name in STEP_PHASES if name != STEP_OTHER)
        assert sum(m[name] for name in STEP_PHASES) == pytest.approx(m[STEP_TIME], rel=1e-9)
    # Checkpoint timings (rank 0, ms): the saving steps 2 and 3 stood still for their snapshots; the final checkpoint
    # is waited for, so step 3's record also has its whole save time.
    assert not {CHECKPOINT_BLOCKING, CHECKPOINT_SAVE} & lines[0]["metrics"].keys()
    assert lines[1]["metrics"][CHECKPOINT_BLOCKING] > 0 and lines[2]["metrics"][CHECKPOINT_BLOCKING] > 0
    assert lines[2]["metrics"][CHECKPOINT_SAVE] >= lines[2]["metrics"][CHECKPOINT_BLOCKING]
    reference = reference_first_step(config, docs[:4])
    assert lines[0]["metrics"]["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    assert lines[0]["metrics"]["new_logprobs"] == pytest.approx(reference["new_logprobs"], rel=1e-5)
    assert "entropy" not in lines[0]["metrics"]  # basic level

    progress = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
    assert (progress["step"], progress["documents_seen"], progress["model_version"]) == ("3", "12", "12")
    assert json.loads(progress["metrics"]) == pytest.approx(lines[-1]["metrics"], nan_ok=True)  # sampler_mismatch_*
    assert read_events(client, config) == [
        {"type": "weights_ready", "step": s, "documents_seen": 4 * s} for s in range(4)
    ] + [{"type": "training_finished", "step": 3, "documents_seen": 12}]

    # Delivery: every entry covered by exactly one committed checkpoint, acked, nothing pending.
    checkpoints = committed_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in checkpoints] == ["step-00000002", "step-00000003"]
    covered = [json.loads((p / COMMIT_FILE).read_text())["covered_entry_ids"] for p in checkpoints]
    assert [sorted(c) for c in covered] == [["fast_llm_consumer_0", "fast_llm_consumer_1"]] * 2
    flat = [entry for c in covered for per_rank in c.values() for entry in per_rank]
    assert sorted(flat) == sorted(ids) and len(flat) == len(set(flat))
    group = client.xinfo_groups(config.keys.stream)[0]
    assert (group["pending"], group["entries-read"], group["consumers"]) == (0, 12, 2)
    assert client.xlen(config.keys.stream) == 0  # acked entries were trimmed

    # The same documents through one in-process rank give the same weights (2 ranks = 1 rank).
    client.flushall()
    single = make_config(redis_server, tmp_path / "single", processes=1, documents_per_step=4, max_steps=3)
    write_documents(client, single, docs)
    result = run(single, client=client, stdout=io.StringIO())
    assert (result.step, result.documents_seen) == (3, 12)
    two_ranks = load_file(tmp_path / "ckpt" / "export" / "model.safetensors")
    one_rank = load_file(Path(result.export_dir) / "model.safetensors")
    assert two_ranks.keys() == one_rank.keys()
    initial = build_model(config.spec.model, DigitTokenizer().vocab_size, 0).state_dict()
    assert not torch.equal(two_ranks["lm_head.weight"], initial["lm_head.weight"])  # it did train
    for name in two_ranks:
        torch.testing.assert_close(two_ranks[name], one_rank[name], rtol=1e-5, atol=1e-6, msg=name)

    # The rollout member got the initial weights at start and the trained weights after every step.
    assert sorted(receiver.received) == [0, 4, 8, 12]
    assert receiver.received[0].keys() == initial.keys()
    for name, value in initial.items():
        assert torch.equal(receiver.received[0][name], value), name
    for name, value in two_ranks.items():
        assert torch.equal(receiver.received[12][name], value), name


def test_ddp_publishes_beside_the_next_step_and_reports_each_step_once_its_weights_are_out(redis_server, tmp_path):
    """An unsharded model on CPU publishes on rank 0's publisher thread while the next step runs (trainer.py,
    ``Trainer.overlaps_publication``): every update still reaches the rollout member with the weights of its step, the
    events keep their order, and each step's record comes after its publication, with its wall time; 2 DDP ranks
    train what one in-process rank trains."""
    ddp = {"strategy": "ddp"}
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=3,
                         every_steps=2, parallelism=ddp)
    client = redis_server.client()
    docs = make_documents(12, seed=1)
    write_documents(client, config, docs)
    receiver, trainer = train_two_ranks_with_a_member(redis_server, config, tmp_path)
    lines = json_lines(trainer)
    assert [(x["step"], x["documents_seen"]) for x in lines] == [(1, 4), (2, 8), (3, 12)]
    for line in lines:
        m = line["metrics"]
        assert line["weight_sync_layout"] == "packed", line
        # The step spent only the publication's start; its wall time ran beside the next step.
        assert 0 < m[WEIGHT_SYNC] < m[WEIGHT_SYNC_OVERLAPPED], m
        assert m[WEIGHT_SYNC_WAIT] >= 0
        assert sum(m[name] for name in STEP_PHASES) == pytest.approx(m[STEP_TIME], rel=1e-9)
    progress = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
    assert WEIGHT_SYNC_OVERLAPPED in json.loads(progress["metrics"])  # the last record waited for its publication
    assert read_events(client, config) == [
        {"type": "weights_ready", "step": s, "documents_seen": 4 * s} for s in range(4)
    ] + [{"type": "training_finished", "step": 3, "documents_seen": 12}]

    exported = load_file(tmp_path / "ckpt" / "export" / "model.safetensors")
    assert sorted(receiver.received) == [0, 4, 8, 12]
    for name, value in exported.items():
        assert torch.equal(receiver.received[12][name], value), name  # the last step's weights, bit for bit
    # Version 8 went out while step 3 ran: it holds step 2's weights (its checkpoint's), not step 3's.
    dcp_to_torch_save(tmp_path / "ckpt" / "step-00000002", tmp_path / "step-2.pt")
    step_2 = torch.load(tmp_path / "step-2.pt", weights_only=False)["model"]
    assert step_2.keys() == exported.keys()
    for name, value in step_2.items():
        assert torch.equal(receiver.received[8][name], value), name
    assert not torch.equal(receiver.received[8]["lm_head.weight"], exported["lm_head.weight"])

    client.flushall()
    single = make_config(redis_server, tmp_path / "single", processes=1, documents_per_step=4, max_steps=3,
                         parallelism=ddp)
    write_documents(client, single, docs)
    out = io.StringIO()
    result = run(single, client=client, stdout=out)
    records = [json.loads(x) for x in out.getvalue().splitlines()]
    assert all(r["metrics"][WEIGHT_SYNC_OVERLAPPED] > 0 and r["weight_sync_layout"] is None for r in records)  # no member
    one_rank = load_file(Path(result.export_dir) / "model.safetensors")
    for name in exported:
        torch.testing.assert_close(exported[name], one_rank[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gspo_with_full_metrics_in_process(redis_server, tmp_path):
    config = make_config(
        redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=1, loss="gspo", metrics="full"
    )
    client = redis_server.client()
    docs = make_documents(4, seed=5)
    write_documents(client, config, docs)
    out = io.StringIO()
    result = run(config, client=client, stdout=out)
    assert (result.step, result.documents_seen) == (1, 4)
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    reference = reference_first_step(config, docs)
    for name in ("loss", "new_logprobs", "entropy"):
        assert line["metrics"][name] == pytest.approx(reference[name], rel=1e-4), name


def test_corrections_reference_kl_and_decay_in_process(redis_server, tmp_path):
    """Importance sampling (dualClip and the clip range are refused beside it: the ratio is 1), a KL penalty to the
    reference and a linear decay, in one process: the reference is the initial policy (kl_ref 0 at the first step,
    then > 0), the corrections' metrics are reported, the learning rate follows the schedule, and the mismatch metric sees every token of the first step (all sampled with version 0)."""
    config = make_config(
        redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=3,
        algorithm={"importanceSampling": {"enabled": True, "cap": 2.0}, "klCoef": 0.05},
        optimizer={"schedule": "linear", "minLearningRate": 1e-3},
    )
    client = redis_server.client()
    write_documents(client, config, make_documents(12, seed=5))
    out = io.StringIO()
    result = run(config, client=client, stdout=out)
    assert (result.step, result.documents_seen) == (3, 12)
    metrics = [json.loads(x)["metrics"] for x in out.getvalue().splitlines()]
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert metrics[1]["kl_ref"] > 1e-6 and metrics[2]["kl_ref"] > 1e-6
    # warm-up 1 (1e-2), then p = 0 (1e-2) and p = 1/2 (1e-3 + 9e-3 / 2) over 3 steps
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-2, 1e-2, 5.5e-3], rel=1e-12)
    first = metrics[0]
    assert first["clipped_ratio_fraction"] == 0.0  # the proximal ratio is 1
    assert first["max_behaviour_weight"] >= first["behaviour_weight"] > 0
    assert 0.0 <= first["behaviour_weight_truncated_fraction"] <= 1.0
    # Every document has 4 labelled tokens, so the token mean over the (all current) tokens is the document mean.
    assert first["sampler_mismatch_tokens"] == first["num_tokens"] == 16
    assert first["sampler_mismatch_ratio"] == pytest.approx(first["ratio_new_old"], rel=1e-6)  # float32 exp or not
    assert metrics[1]["sampler_mismatch_tokens"] == 0.0  # version 0 is 4 documents behind at step 2


def test_max_staleness_drops_refills_counts_and_acks_with_the_checkpoint(redis_server, tmp_path):
    """algorithm.maxStaleness = 3, 4 documents per step: step 1 (documents_seen 0) trains 4 documents of version 0;
    step 2 (documents_seen 4) drops the next 2 of version 0 (4 behind), refills with 4 of version 4, and the
    checkpoint at step 2 (the first) covers and acks all 10 entries, the 2 drops with the published count."""
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=2,
                         algorithm={"maxStaleness": 3})
    client = redis_server.client()
    ids = write_documents(client, config, make_documents(6, seed=5, model_version=0))
    ids += write_documents(client, config, make_documents(4, seed=6, model_version=4))
    out = io.StringIO()
    result = run(config, client=client, stdout=out)
    assert (result.step, result.documents_seen) == (2, 8)  # only documents that entered the loss
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [line["stream"]["dropped_stale"] for line in lines] == [0, 2]
    assert [line["metrics"]["max_staleness"] for line in lines] == [0.0, 0.0]  # none of them was trained
    (path,) = committed_checkpoints(tmp_path / "ckpt")
    commit = json.loads((path / COMMIT_FILE).read_text())
    assert commit["step"] == 2
    assert sorted(e for entries in commit["covered_entry_ids"].values() for e in entries) == sorted(ids)
    assert client.xpending(config.keys.stream, config.keys.group)["pending"] == 0
    progress = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
    assert (progress["dropped_stale"], progress["checkpoint_dropped_stale"]) == ("2", "2")


@pytest.mark.parametrize("loss, metrics", [("grpo", "basic"), ("gspo", "full")])
def test_each_micro_batch_is_segmented_once(redis_server, tmp_path, monkeypatch, loss, metrics):
    # The normaliser counts, the loss and the metrics of a micro-batch share one segment_documents (one device
    # sync). Every caller reaches it through the module attribute: no trainer module holds its own reference.
    import rljob_trainer.loss as losses
    from rljob_trainer.trainer import Trainer

    original, segmented, trained = losses.segment_documents, [], []
    holders = [n for n, m in sys.modules.items() if n.startswith("rljob_trainer") and m is not losses
               and getattr(m, "segment_documents", None) is original]
    assert holders == []

    def counting_segments(label_mask, document_index):
        segmented.append(label_mask.numel())
        return original(label_mask, document_index)

    def counting_loss(self, mb, *args):
        trained.append(mb.label_mask.numel())
        return micro_batch_loss(self, mb, *args)

    micro_batch_loss = Trainer._micro_batch_loss
    monkeypatch.setattr(losses, "segment_documents", counting_segments)
    monkeypatch.setattr(Trainer, "_micro_batch_loss", counting_loss)
    config = make_config(
        redis_server, tmp_path / "ckpt", processes=1, documents_per_step=4, max_steps=1, loss=loss, metrics=metrics
    )
    client = redis_server.client()
    write_documents(client, config, make_documents(4, seed=6))
    out = io.StringIO()
    run(config, client=client, stdout=out)
    assert len(trained) == 2  # 4 documents of 10 tokens in micro-batches of at most 24 tokens
    assert segmented == trained  # once per micro-batch, in training order
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["metrics"]["num_tokens"] == 4 * 4 and line["stream"]["redeliveries"] == 0


def test_world_size_mismatch_exits_non_zero_with_the_numbers(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1)  # dataParallelSize 1
    trainer = Torchrun(write_config(config, tmp_path / "config.json"), 2, free_port(), redis_server.password, tmp_path, "bad")
    status = trainer.wait(120)
    trainer.kill()
    assert status != 0
    assert "WORLD_SIZE=2 / (tensorParallel=1 × pipelineParallel=1) = 2 but the config's dataParallelSize is 1" in (
        trainer.stderr_path.read_text()
    )
    assert redis_server.client().xlen(config.keys.events) == 0  # it never started training


def test_no_data_fails_with_a_clear_error_after_the_data_timeout(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=1, data_timeout_seconds=1)
    client = redis_server.client()
    with pytest.raises(DataTimeout, match="no valid document on stream 'fast_llm_streaming' for 1 s"):
        run(config, client=client, stdout=io.StringIO())
    assert not dist.is_initialized()
    assert read_events(client, config) == [{"type": "weights_ready", "step": 0, "documents_seen": 0}]
