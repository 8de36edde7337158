"""The cpu backend: log-probability agreement with the trainer's recomputation, stopping, weight loading."""

from __future__ import annotations

import pytest
import torch

from rljob_api.spec import ModelSpec, SamplingSpec, TinyModelSpec
from rljob_wire.model import DigitTokenizer, build_model, sequence_logprobs
from rljob_rollout.backends.cpu import CpuBackend
from rljob_rollout.writer import make_document

TOK = DigitTokenizer()
SPEC = ModelSpec(source="tiny", tiny=TinyModelSpec(layers=2, hidden_size=32, heads=2, intermediate_size=64, max_position_embeddings=64))


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    torch.manual_seed(0)
    return CpuBackend(build_model(SPEC, TOK.vocab_size, seed=3), pad_token_id=0, eos_token_id=TOK.eos_token_id)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_old_logprobs_equal_the_trainers_recomputation(backend, temperature, top_p):
    """At equal weights, sequence_logprobs of the rollout's tokens = its old_log_probabilities (fp32, CPU)."""
    prompts = [TOK.encode("1234|"), TOK.encode("98|"), TOK.encode("5|")]  # different lengths: left padding
    sampling = SamplingSpec(temperature=temperature, top_p=top_p, max_new_tokens=6)
    groups = backend.generate(prompts, 3, sampling)
    assert [len(g) for g in groups] == [3, 3, 3]
    docs = [
        make_document(prompt, c.token_ids, c.logprobs, reward=0.0, advantage=0.0, model_version=0)
        for prompt, group in zip(prompts, groups)
        for c in group
    ]
    width = max(d.num_tokens for d in docs)
    input_ids = torch.zeros((len(docs), width), dtype=torch.int64)
    mask = torch.zeros((len(docs), width), dtype=torch.int64)
    for row, doc in enumerate(docs):
        input_ids[row, : doc.num_tokens] = torch.from_numpy(doc.tokens)
        mask[row, : doc.num_tokens] = 1
    with torch.no_grad():
        recomputed = sequence_logprobs(backend.model, input_ids, mask, temperature)
    checked = 0
    for row, doc in enumerate(docs):
        labels = torch.from_numpy(doc.label_mask())
        old = torch.from_numpy(doc.old_log_probabilities.copy())
        torch.testing.assert_close(recomputed[row, : doc.num_tokens][labels], old[labels], rtol=0, atol=2e-5)
        assert (old[~labels] == 0).all()
        checked += int(labels.sum())
    assert checked >= len(docs)  # every document has labelled tokens
    assert all(lp <= 0 for g in groups for c in g for lp in c.logprobs)


def test_completions_stop_at_eos_and_at_the_length_limit(backend):
    # Make <eos> overwhelmingly likely, then impossible, through the output bias.
    head = backend.model.get_output_embeddings()
    original = None if head.bias is None else head.bias.clone()
    bias = torch.zeros(TOK.vocab_size)
    bias[TOK.eos_token_id] = 50.0
    head.bias = torch.nn.Parameter(bias)
    try:
        stopped = backend.generate([TOK.encode("12|")], 2, SamplingSpec(max_new_tokens=5))[0]
        assert [(c.token_ids, c.finish_reason) for c in stopped] == [((TOK.eos_token_id,), "stop")] * 2
        head.bias.data[TOK.eos_token_id] = -50.0
        full = backend.generate([TOK.encode("12|")], 2, SamplingSpec(max_new_tokens=5))[0]
        assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in full)
        assert all(TOK.eos_token_id not in c.token_ids for c in full)
    finally:
        head.bias = None if original is None else torch.nn.Parameter(original)


def test_load_weights_is_all_or_nothing(backend):
    source = build_model(SPEC, TOK.vocab_size, seed=11)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    named = list(source.state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        backend.load_weights(named[:-1])
    with pytest.raises(ValueError, match="unknown"):
        backend.load_weights(named + [("not.a.parameter", torch.zeros(1))])
    bad_shape = [(n, t if i else t[:1]) for i, (n, t) in enumerate(named)]
    with pytest.raises(ValueError, match="shape"):
        backend.load_weights(bad_shape)
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed by a refused update"
    backend.load_weights(named)
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[name])
    backend.load_weights(before.items())
