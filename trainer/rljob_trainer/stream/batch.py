"""Pack decoded documents into micro-batches: padded [B, L] tensors for the model, flat [T] tensors for the loss.

Layout: one document per row, right-padded, so attention never crosses documents. The flat views list the
real tokens of row 0, then row 1, ... (row-major over ``attention_mask``), T = sum of document lengths; the
trainer turns any per-position model output [B, L, ...] into that order with :func:`flat_from_padded`.

Alignment (DESIGN §2 "Token alignment"): for a document of length T_d,
``old_logprobs[t] = log p(tokens[t] | tokens[<t])`` under the sampling policy, and the label at position t
is ``tokens[t]`` itself. The trainer computes the same quantity with
:func:`rljob_wire.model.sequence_logprobs` (logits at position t-1 scored against ``input_ids[:, t]``,
0 at t = 0), flattens it, and uses ``label_mask`` (False at t = 0 and inside loss-masking spans, see
:func:`~rljob_wire.codec.label_masks`) to select the labelled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np
import torch

from rljob_wire.codec import Document, label_masks


@dataclass(frozen=True)
class MicroBatch:
    """Documents packed for one forward/backward pass. B documents, longest L tokens, T tokens in total.

    Attributes:
        input_ids: [B, L] int64, one document per row, right-padded with 0.
        attention_mask: [B, L] bool, True on real tokens.
        lengths: [B] int64, tokens per document.
        document_index: [T] int64, row (0..B-1) of each flat token.
        label_mask: [T] bool, True on labelled (completion) tokens.
        old_logprobs: [T] float32, sampling-policy log p(token[t] | tokens[<t]).
        advantages: [T] float32, each document's advantage broadcast to its tokens.
        model_version: [T] int64 (documents seen) or None unless every document carries it.
        rewards: [B] float32 raw rewards, or None unless every document carries one.
        source_indices: position of each row's document in the list given to :func:`pack_documents`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    document_index: torch.Tensor
    label_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    model_version: Optional[torch.Tensor]
    rewards: Optional[torch.Tensor]
    source_indices: tuple[int, ...]

    @property
    def num_documents(self) -> int:
        """B, documents (rows) in the micro-batch."""
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """T, real tokens (prompt + completion, no padding) in the micro-batch."""
        return self.document_index.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "MicroBatch":
        """The same micro-batch with every tensor on ``device``."""
        moved = {
            f.name: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
            for f in fields(self)
            for value in [getattr(self, f.name)]
        }
        return MicroBatch(**moved)


def flat_from_padded(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Select the real positions of a padded per-position tensor, in the micro-batch's flat order.

    Args:
        x: [B, L, ...] any dtype, e.g. per-token log-probabilities [B, L] float32.
        attention_mask: [B, L] bool, the micro-batch's ``attention_mask``.

    Returns:
        [T, ...] with T = attention_mask.sum(); differentiable with respect to ``x``.

    Raises:
        ValueError: the leading two dimensions of ``x`` differ from the mask's shape.
    """
    if tuple(x.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(f"x has shape {list(x.shape)}, expected [B, L, ...] = {list(attention_mask.shape)} first")
    return x[attention_mask.bool()]


def pack_documents(docs: Sequence[Document], micro_batch_tokens: int) -> list[MicroBatch]:
    """Pack documents into micro-batches of at most ``micro_batch_tokens`` real tokens each.

    Greedy "next fit decreasing": documents sorted by length (longest first, ties in input order) fill the
    current micro-batch until the next one would exceed the budget. Sorting puts similar lengths in one
    micro-batch, which keeps the padding of the [B, L] tensors small. The budget counts real tokens, so a
    micro-batch's padded size B*L may exceed it.

    Args:
        docs: decoded documents; each must have an ``advantage`` and at most ``micro_batch_tokens`` tokens
            (the reader drops or dead-letters any other).
        micro_batch_tokens: token budget per micro-batch (sum of document lengths).

    Returns:
        The micro-batches; every document appears in exactly one, at ``source_indices``.

    Raises:
        ValueError: a document is longer than the budget or has no advantage (names its index).
    """
    lengths = [len(doc.tokens) for doc in docs]
    for index, (doc, length) in enumerate(zip(docs, lengths, strict=True)):
        if length > micro_batch_tokens:
            raise ValueError(f"docs[{index}] has {length} tokens > micro_batch_tokens={micro_batch_tokens}")
        if doc.advantage is None:
            raise ValueError(f"docs[{index}] has no advantage")
    groups: list[list[int]] = []
    used = micro_batch_tokens + 1
    for index in sorted(range(len(docs)), key=lambda i: -lengths[i]):
        if used + lengths[index] > micro_batch_tokens:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += lengths[index]
    return [_build([docs[i] for i in group], tuple(group)) for group in groups]


def _build(group: list[Document], source_indices: tuple[int, ...]) -> MicroBatch:
    count = len(group)
    lengths = np.fromiter((len(doc.tokens) for doc in group), dtype=np.int64, count=count)
    # Right padding in row-major order: the True positions of attention_mask, read row by row, are the flat order.
    attention_mask = np.arange(int(lengths.max()), dtype=np.int64)[None, :] < lengths[:, None]
    input_ids = np.zeros(attention_mask.shape, dtype=np.int64)
    input_ids[attention_mask] = np.concatenate([doc.tokens for doc in group])
    advantages = np.array([doc.advantage for doc in group], dtype=np.float32)
    versions = [doc.model_version for doc in group]
    rewards = [doc.reward for doc in group]
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        lengths=torch.from_numpy(lengths),
        document_index=torch.from_numpy(np.repeat(np.arange(count, dtype=np.int64), lengths)),
        label_mask=torch.from_numpy(label_masks(group)),
        old_logprobs=torch.from_numpy(np.concatenate([doc.old_log_probabilities for doc in group], dtype=np.float32)),
        advantages=torch.from_numpy(np.repeat(advantages, lengths)),
        model_version=None
        if any(v is None for v in versions)
        else torch.from_numpy(np.concatenate(versions, dtype=np.int64)),
        rewards=None if any(r is None for r in rewards) else torch.from_numpy(np.array(rewards, dtype=np.float32)),
        source_indices=source_indices,
    )
