"""The causal LM and tokenizer both roles load, and the per-token log-probabilities both roles compute.

The trainer and the rollout workers must agree on log p(tokens[t] | tokens[<t]) at the sampling
temperature (DESIGN §2 "Token alignment"); :func:`sequence_logprobs` is the one place that computes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from rljob_api import constants as c
from rljob_api.spec import DIGIT_TASKS, ModelSpec, TaskSpec


DIGITS_ALPHABET = "0123456789"
"""The toy task's alphabet: with the 4 special ids a vocabulary of 14, so a random policy scores ~1/14 per digit."""
TEXT_ALPHABET = "0123456789 +-=?abcdefghijklmnopqrstuvwxyz"
"""The alphabet of a ``tiny`` model running a text task (``math``, ``custom``): a vocabulary of 45."""


@dataclass(frozen=True)
class DigitTokenizer:
    """A fixed character-level tokenizer for ``tiny`` models (no downloads).

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``|`` (prompt/completion separator), then one id per
    character of :attr:`alphabet`. Characters outside the alphabet raise ``ValueError``.

    The default alphabet is the ten digits (vocabulary 14): the toy task's random policy starts near 1/14
    per digit and learns faster than with :data:`TEXT_ALPHABET` (vocabulary 45). Measured on 4-digit copy,
    32 prompts x 16 samples, lr 2e-3, synchronous: mean reward 0.8 reached at steps 53-89 over 5 seeds with
    vocabulary 14, at 80, 91 and never (0.79 at step 100) over 3 seeds with vocabulary 45. Pass
    ``alphabet=TEXT_ALPHABET`` for text prompts (:func:`build_tokenizer` does so for ``math`` and ``custom``).
    """

    alphabet: str = DIGITS_ALPHABET
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    sep_token_id: int = 3
    num_special: int = 4

    @property
    def vocab_size(self) -> int:
        return self.num_special + len(self.alphabet)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Character ids; with ``add_special_tokens`` a leading ``<bos>``. ``|`` maps to the separator."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for ch in text:
            if ch == "|":
                ids.append(self.sep_token_id)
                continue
            index = self.alphabet.find(ch)
            if index < 0:
                raise ValueError(f"DigitTokenizer: character {ch!r} is not in its alphabet {self.alphabet!r}")
            ids.append(self.num_special + index)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        specials = {self.pad_token_id: "<pad>", self.bos_token_id: "<bos>", self.eos_token_id: "<eos>"}
        out = []
        for i in ids:
            i = int(i)
            if i == self.sep_token_id:
                out.append("|")
            elif i in specials:
                if not skip_special_tokens:
                    out.append(specials[i])
            else:
                out.append(self.alphabet[i - self.num_special])
        return "".join(out)


def build_tokenizer(spec: ModelSpec, task: Optional[TaskSpec] = None) -> Any:
    """The tokenizer of a model spec: :class:`DigitTokenizer` for ``tiny``, else ``AutoTokenizer``.

    For ``tiny`` the alphabet follows the task (the trainer and every rollout worker pass the same
    ``spec.rollout.task``, so they agree on the vocabulary size): :data:`DIGITS_ALPHABET` for the digit
    tasks (:data:`~rljob_api.spec.DIGIT_TASKS`, and when ``task`` is None), :data:`TEXT_ALPHABET` for ``math`` and
    ``custom``.

    Raises:
        OSError: the Hugging Face model id or path cannot be loaded.
    """
    if spec.source == "tiny":
        text = task is not None and task.name not in DIGIT_TASKS
        return DigitTokenizer(alphabet=TEXT_ALPHABET if text else DIGITS_ALPHABET)
    from transformers import AutoTokenizer

    where = spec.path if spec.source == "path" else spec.name
    tokenizer = AutoTokenizer.from_pretrained(where, revision=spec.revision, token=os.environ.get(c.ENV_HF_TOKEN))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_config(spec: ModelSpec, vocab_size: int) -> Any:
    """The ``transformers.LlamaConfig`` of a ``tiny`` model spec: ``spec.tiny``'s shape, ``vocab_size`` tokens (the
    tokenizer's), untied embeddings, pad/bos/eos ids 0/1/2 (:class:`DigitTokenizer`)."""
    from transformers import LlamaConfig

    t = spec.tiny
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.layers,
        num_attention_heads=t.heads,
        num_key_value_heads=t.heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_model(spec: ModelSpec, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A transformers causal LM, whole in this process: a seeded random Llama for ``tiny``, else ``from_pretrained``.

    The tiny model is identical for the same (spec, vocab_size, seed) on every rank and role, so the
    rollout's initial weights equal the trainer's before the first transfer (the trainer builds it on the meta
    device and replays this initialisation one tensor at a time: :func:`rljob_trainer.loading.init_tiny_weights`).

    Raises:
        OSError: a Hugging Face id or path cannot be loaded.
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if spec.source == "tiny":
        devices_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(spec, vocab_size))
        torch.random.set_rng_state(devices_state)
        return model.float()
    where = spec.path if spec.source == "path" else spec.name
    return AutoModelForCausalLM.from_pretrained(
        where, revision=spec.revision, token=os.environ.get(c.ENV_HF_TOKEN), torch_dtype=torch.bfloat16
    )


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probabilities of right-padded documents, one document per row.

    Args:
        input_ids: [B, L] int64, each row one document (prompt + completion), right-padded.
        attention_mask: [B, L] bool/int, 1 on real tokens. Rows never attend to each other, so packed
            documents never see each other.
        temperature: the sampling temperature; logits are divided by it before the softmax.

    Returns:
        [B, L] float32 with ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` at ``temperature``
        for 1 <= t < length(b), and 0 at t = 0 and on padding. Differentiable when grad is enabled.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, V]
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    token_lp = -F.cross_entropy(scaled.transpose(1, 2), targets, reduction="none")  # [B, L-1]
    first = torch.zeros_like(token_lp[:, :1])
    return torch.cat([first, token_lp * attention_mask[:, 1:].to(token_lp.dtype)], dim=1)
