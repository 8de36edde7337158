"""Observations of a multi-turn episode through a chat template (issue 27 item 2, the chat-template path): the ids
appended turn by turn (first observation, sampled ids, each later observation) are exactly the tokens of the whole
conversation rendered at once, whether or not the model ended its turn with the end-of-sequence token; a template that
renders earlier messages differently once one is added is refused (no continuation exists).

The tokenizer is a real transformers ``PreTrainedTokenizerFast``: byte-level, no merges (every byte a token, so any
text encodes and tokenization is concatenative), ChatML's special tokens and template, as Qwen's models have."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_files import CHATML
from rljob_rollout.environments.episodes import ObservationEncoder
from rljob_rollout.environments.sessions import ObservationError

REWRITES_HISTORY = ("{% for m in messages %}{% if loop.last and m.role == 'assistant' %}[final] {% endif %}"
                    "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def chat_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = template
    return tokenizer


TOKENIZER = chat_tokenizer()
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="<>|"), min_size=1, max_size=12)


def at_once(messages: list[dict[str, str]]) -> list[int]:
    rendered = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return TOKENIZER.encode(rendered, add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(TEXT, TEXT, st.booleans()), min_size=1, max_size=4), TEXT)
def test_turn_by_turn_ids_are_the_whole_conversation_rendered_at_once(turns, first):
    encoder = ObservationEncoder(TOKENIZER)
    ids = encoder.first(first)
    messages = [{"role": "user", "content": first}]
    assert ids == at_once(messages)
    for answer, observation, ended_with_eos in turns:
        sampled = TOKENIZER.encode(answer, add_special_tokens=False) + ([TOKENIZER.eos_token_id] if ended_with_eos else [])
        ids += sampled + encoder.next(observation, ended_with_eos)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": observation}]
        assert ids == at_once(messages), messages


def test_the_end_of_sequence_token_the_model_sampled_is_not_appended_twice():
    encoder = ObservationEncoder(TOKENIZER)
    after_eos = TOKENIZER.decode(encoder.next("+ 6 to 9", ended_with_eos=True))
    cut_off = TOKENIZER.decode(encoder.next("+ 6 to 9", ended_with_eos=False))
    assert after_eos == "\n<|im_start|>user\n+ 6 to 9<|im_end|>\n<|im_start|>assistant\n"
    assert cut_off == "<|im_end|>" + after_eos  # a turn cut by maxNewTokens is closed by the observation


def test_a_template_that_rewrites_earlier_messages_is_refused():
    encoder = ObservationEncoder(chat_tokenizer(REWRITES_HISTORY))
    with pytest.raises(ObservationError, match="renders earlier messages differently"):
        encoder.next("+ 6 to 9", ended_with_eos=False)
