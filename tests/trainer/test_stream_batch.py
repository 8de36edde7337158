"""Micro-batch packing: token budget, padded and flat layouts, alignment with the model's log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rljob_api.spec import ModelSpec
from rljob_wire.model import build_model, sequence_logprobs
from rljob_trainer.stream.batch import flat_from_padded, pack_documents
from rljob_wire.codec import Document

torch.set_num_threads(1)


def document(length: int, seed: int, *, spans=((0, 2),), version=True, reward=True) -> Document:
    rng = np.random.default_rng(seed)
    return Document(
        tokens=rng.integers(3, 40, length),
        old_log_probabilities=-rng.random(length).astype(np.float32),
        model_version=np.full(length, 100 + seed, np.int64) if version else None,
        loss_masking_spans=list(spans),
        advantage=float(seed) - 0.5,
        reward=float(seed) / 10 if reward else None,
    )


def test_next_fit_decreasing_respects_the_budget():
    docs = [document(n, i) for i, n in enumerate([3, 5, 2, 4])]
    batches = pack_documents(docs, micro_batch_tokens=7)
    assert [b.source_indices for b in batches] == [(1,), (3, 0), (2,)]
    assert [b.num_tokens for b in batches] == [5, 7, 2]
    assert [b.num_documents for b in batches] == [1, 2, 1]
    assert pack_documents([], 7) == []


def test_padded_and_flat_views_agree_with_the_documents():
    docs = [document(6, 1), document(3, 2, spans=()), document(5, 3, spans=((1, 3), (4, 5)))]
    (batch,) = pack_documents(docs, micro_batch_tokens=14)
    order = [docs[i] for i in batch.source_indices]
    assert batch.source_indices == (0, 2, 1)
    assert batch.input_ids.shape == (3, 6) and batch.input_ids.dtype == torch.int64
    assert batch.lengths.tolist() == [6, 5, 3]
    assert batch.attention_mask.tolist() == [[True] * 6, [True] * 5 + [False], [True] * 3 + [False] * 3]
    for row, doc in enumerate(order):
        assert batch.input_ids[row, : doc.num_tokens].tolist() == doc.tokens.tolist()
        assert batch.input_ids[row, doc.num_tokens :].eq(0).all()
    assert batch.num_tokens == 14
    assert batch.document_index.tolist() == [0] * 6 + [1] * 5 + [2] * 3
    assert batch.label_mask.tolist() == [
        False, False, True, True, True, True,  # span [0, 2)
        False, False, False, True, False,  # spans [1, 3), [4, 5)
        False, True, True,  # no span: only t = 0
    ]  # fmt: skip
    np.testing.assert_array_equal(batch.old_logprobs.numpy(), np.concatenate([d.old_log_probabilities for d in order]))
    assert batch.old_logprobs.dtype == torch.float32 and batch.advantages.dtype == torch.float32
    assert batch.advantages.tolist() == [0.5] * 6 + [2.5] * 5 + [1.5] * 3
    assert batch.model_version.tolist() == [101] * 6 + [103] * 5 + [102] * 3
    assert batch.rewards.tolist() == pytest.approx([0.1, 0.3, 0.2])
    assert (
        flat_from_padded(batch.input_ids, batch.attention_mask).tolist()
        == np.concatenate([d.tokens for d in order]).tolist()
    )


def test_optional_fields_are_none_unless_every_document_has_them():
    (batch,) = pack_documents([document(4, 1), document(4, 2, version=False, reward=False)], 8)
    assert batch.model_version is None and batch.rewards is None


def test_bad_documents_are_refused_with_their_index():
    with pytest.raises(ValueError, match=r"docs\[1\] has 9 tokens > micro_batch_tokens=8"):
        pack_documents([document(4, 0), document(9, 1)], 8)
    no_advantage = document(4, 0)
    no_advantage.advantage = None
    with pytest.raises(ValueError, match=r"docs\[0\] has no advantage"):
        pack_documents([no_advantage], 8)
    with pytest.raises(ValueError, match=r"expected \[B, L, \.\.\.\] = \[2, 3\]"):
        flat_from_padded(torch.zeros(3, 2), torch.ones(2, 3, dtype=torch.bool))


def test_flat_logprobs_of_a_padded_batch_equal_each_document_alone():
    """Rows never see each other: packed, padded and flattened log-probabilities equal per-document ones,
    and their gradient flows back through flat_from_padded."""
    spec = ModelSpec.model_validate({"source": "tiny", "tiny": {"layers": 1, "hiddenSize": 16, "heads": 2, "intermediateSize": 32}})
    model = build_model(spec, vocab_size=40, seed=0)
    docs = [document(9, 1), document(4, 2), document(7, 3)]
    (batch,) = pack_documents(docs, micro_batch_tokens=32)
    padded = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    flat = flat_from_padded(padded, batch.attention_mask)
    assert flat.shape == (batch.num_tokens,)
    with torch.no_grad():
        alone = [
            sequence_logprobs(
                model, torch.from_numpy(docs[i].tokens)[None], torch.ones(1, docs[i].num_tokens, dtype=torch.bool)
            )[0]
            for i in batch.source_indices
        ]
    torch.testing.assert_close(flat.detach(), torch.cat(alone), atol=1e-5, rtol=1e-5)
    (flat * batch.label_mask).sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_to_moves_every_tensor():
    (batch,) = pack_documents([document(4, 1)], 8)
    moved = batch.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.model_version.device.type == "meta"
    assert moved.source_indices == batch.source_indices
