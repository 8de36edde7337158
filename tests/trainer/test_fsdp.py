"""One training step under each data-parallel strategy equals the 1-rank reference (issue 10, DESIGN §4, §5).

Each case runs the real trainer (``torchrun`` of 2 or 4 gloo ranks, ``python -m rljob_trainer.train``) for one
step on 8 documents from a real Redis, every rank with several micro-batches (one document each), and compares
with one in-process rank trained on the same documents: the step's loss and every metric (level ``full``) in the
JSON line, and every parameter of the exported weights. The reference runs ``ddp`` on one rank (no sharding at
all); the cases run FSDP2 over 2 and 4 ranks, HSDP on a 2×2 mesh and DDP over 2 ranks, with GRPO and GSPO.
Tolerances: those of the checkpoint-reshard tests (the documents of a step are summed in another order).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from portutil import free_port
from rljob_trainer.metrics_registry import TIMINGS, WEIGHT_SYNC_OVERLAPPED
from rljob_trainer.train import run
from rljob_wire.codec import Document
from rljob_wire.model import DigitTokenizer
from train_harness import Torchrun, json_lines, make_config, make_documents, write_config, write_documents

torch.set_num_threads(1)
DOCUMENTS = 8
MICRO_BATCH_TOKENS = 16  # one 10-token document per micro-batch: 2-4 backward passes per rank and step
TIMED = {t.name for t in TIMINGS}  # wall-clock figures: present in both records, never equal


pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def one_step(redis_server, tmp_path: Path, tag: str, loss: str, ranks: int, parallelism: dict, documents=None):
    """Train one step on ``documents`` (default :data:`DOCUMENTS` seeded ones) on ``ranks`` ranks; return (JSON line,
    exported weights)."""
    client = redis_server.client()
    client.flushall()
    config = make_config(redis_server, tmp_path / tag, processes=ranks, documents_per_step=DOCUMENTS, max_steps=1,
                         every_steps=1, loss=loss, metrics="full", parallelism=parallelism,
                         micro_batch_tokens=MICRO_BATCH_TOKENS)
    write_documents(client, config, documents or make_documents(DOCUMENTS, seed=7))
    if ranks == 1:
        out = io.StringIO()
        result = run(config, client=client, stdout=out)
        (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
        return line, load_file(Path(result.export_dir) / "model.safetensors")
    trainer = Torchrun(write_config(config, tmp_path / f"{tag}.json"), ranks, free_port(), redis_server.password,
                       tmp_path, tag)
    assert trainer.wait(300) == 0, trainer.logs()
    trainer.kill()
    (line,) = json_lines(trainer)
    return line, load_file(tmp_path / tag / "export" / "model.safetensors")


@pytest.mark.parametrize("loss,ranks,parallelism", [
    ("grpo", 2, {"strategy": "fsdp"}),
    ("gspo", 2, {"strategy": "fsdp"}),
    ("grpo", 4, {"strategy": "fsdp"}),
    ("gspo", 4, {"strategy": "fsdp", "replicate": 2}),  # HSDP: 2 replica groups x 2 shards
    ("grpo", 2, {"strategy": "ddp"}),
], ids=["fsdp2-grpo", "fsdp2-gspo", "fsdp4-grpo", "hsdp2x2-gspo", "ddp2-grpo"])
def test_one_step_equals_the_one_rank_reference(redis_server, tmp_path, loss, ranks, parallelism):
    reference_line, reference = one_step(redis_server, tmp_path, "reference", loss, 1, {"strategy": "ddp"})
    line, weights = one_step(redis_server, tmp_path, "case", loss, ranks, parallelism)

    assert (line["step"], line["documents_seen"]) == (reference_line["step"], reference_line["documents_seen"]) == (1, 8)
    # An unsharded model publishes beside the next step (its record has the publication's own wall time too).
    unsharded = parallelism["strategy"] == "ddp"
    overlapped = {WEIGHT_SYNC_OVERLAPPED}
    assert WEIGHT_SYNC_OVERLAPPED in reference_line["metrics"] and (WEIGHT_SYNC_OVERLAPPED in line["metrics"]) == unsharded
    assert line["metrics"].keys() - overlapped == reference_line["metrics"].keys() - overlapped
    assert {"loss", "grad_norm", "entropy", "clipped_ratio_fraction", "kl_new_old", "staleness"} <= line["metrics"].keys()
    assert TIMED - overlapped <= line["metrics"].keys()  # the only step saves and waits for its checkpoint
    for name, value in reference_line["metrics"].items():
        if name not in TIMED:
            assert line["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert line["stream"] == reference_line["stream"]

    assert weights.keys() == reference.keys()
    initial = one_step_initial_weights(redis_server, tmp_path)
    assert not torch.equal(weights["lm_head.weight"], initial["lm_head.weight"])  # the step changed the weights
    for name in reference:
        assert weights[name].dtype == torch.float32, name
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def one_step_initial_weights(redis_server, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The weights every rank starts from (the seeded tiny model of :func:`make_config`)."""
    from rljob_wire.model import DigitTokenizer, build_model

    config = make_config(redis_server, tmp_path / "initial", processes=1)
    return build_model(config.spec.model, DigitTokenizer().vocab_size, config.spec.trainer.seed).state_dict()


def short_document(rng: np.random.Generator) -> Document:
    """A 4-token digit document: <bos>, a prompt digit, the separator, a completion digit (prompt labels masked)."""
    tokens = np.asarray(DigitTokenizer().encode(f"{rng.integers(0, 10)}|{rng.integers(0, 10)}"), dtype=np.int64)
    old = np.zeros(len(tokens), dtype=np.float32)
    old[3] = rng.uniform(-3.0, -1.0)
    return Document(tokens=tokens, old_log_probabilities=old, model_version=np.zeros(len(tokens), dtype=np.int64),
                    loss_masking_spans=[(0, 3)], advantage=float(rng.normal()), reward=float(rng.uniform()))


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_fsdp_ranks_with_unequal_micro_batch_counts_match_one_rank(redis_server, tmp_path, loss):
    """Documents of other lengths: the rank that reads the four 10-token documents packs 4 micro-batches, the other
    the four 4-token ones 1; FSDP reduce-scatters in every backward, so without the padding backwards (which add
    nothing to the gradients) the second rank would leave the first waiting in its second backward."""
    rng = np.random.default_rng(3)
    documents = make_documents(4, seed=11) + [short_document(rng) for _ in range(4)]  # the first reader takes 4 long
    reference_line, reference = one_step(redis_server, tmp_path, "reference", loss, 1, {"strategy": "ddp"}, documents)
    line, weights = one_step(redis_server, tmp_path, "case", loss, 2, {"strategy": "fsdp"}, documents)
    assert line["documents_seen"] == reference_line["documents_seen"] == 8
    for name, value in reference_line["metrics"].items():
        if name not in TIMED:
            assert line["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
