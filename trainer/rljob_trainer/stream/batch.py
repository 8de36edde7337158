"""Pack decoded documents into micro-batches: padded [B, L] tensors for the model, flat [T] tensors for the loss.

Layout: one document per row, right-padded, so attention never crosses documents. The flat views list the
real tokens of row 0, then row 1, ... (row-major over ``attention_mask``), T = sum of document lengths; the
trainer turns any per-position model output [B, L, ...] into that order with :func:`flat_from_padded`.

Alignment (DESIGN §2 "Token alignment"): for a document of length T_d,
``old_logprobs[t] = log p(tokens[t] | tokens[<t])`` under the sampling policy, and the label at position t
is ``tokens[t]`` itself. The trainer computes the same quantity with
:func:`rljob_wire.model.sequence_logprobs` (logits at position t-1 scored against ``input_ids[:, t]``,
0 at t = 0), flattens it, and uses ``label_mask`` (False at t = 0 and inside loss-masking spans, see
:func:`~rljob_wire.documents.label_masks`) to select the labelled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np
import torch

from rljob_wire.documents import Document, DocumentColumns, token_positions


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
        source_indices: position of each row's document in the columns given to :func:`pack_columns`.
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
    """:func:`pack_columns` of ``docs`` (:meth:`DocumentColumns.from_documents`); ``source_indices`` index ``docs``.

    Raises:
        ValueError: a document is longer than the budget or has no advantage (names its index).
    """
    return pack_columns(DocumentColumns.from_documents(docs), micro_batch_tokens)


def pack_columns(columns: DocumentColumns, micro_batch_tokens: int) -> list[MicroBatch]:
    """Pack documents into micro-batches of at most ``micro_batch_tokens`` real tokens each.

    Greedy "next fit decreasing": documents sorted by length (longest first, ties in input order) fill the
    current micro-batch until the next one would exceed the budget. Sorting puts similar lengths in one
    micro-batch, which keeps the padding of the [B, L] tensors small. The budget counts real tokens, so a
    micro-batch's padded size B*L may exceed it.

    Args:
        columns: decoded documents; each must have an ``advantage`` and at most ``micro_batch_tokens`` tokens
            (the reader drops or dead-letters any other).
        micro_batch_tokens: token budget per micro-batch (sum of document lengths).

    Returns:
        The micro-batches; every document appears in exactly one, at ``source_indices`` (its index in ``columns``).

    Raises:
        ValueError: a document is longer than the budget or has no advantage (names its index).
    """
    lengths = columns.lengths
    too_long = np.flatnonzero(lengths > micro_batch_tokens)
    if len(too_long):
        index = int(too_long[0])
        raise ValueError(f"docs[{index}] has {lengths[index]} tokens > micro_batch_tokens={micro_batch_tokens}")
    no_advantage = np.flatnonzero(np.isnan(columns.advantages))
    if len(no_advantage):
        raise ValueError(f"docs[{int(no_advantage[0])}] has no advantage")
    order = np.argsort(-lengths, kind="stable")
    groups: list[int] = []  # where each micro-batch starts in ``order``
    used = micro_batch_tokens + 1
    for position, length in enumerate(lengths[order].tolist()):
        if used + length > micro_batch_tokens:
            groups.append(position)
            used = 0
        used += length
    bounds = [*groups, len(order)]
    return [_build(columns, order[begin:end]) for begin, end in zip(bounds[:-1], bounds[1:])]


def _build(columns: DocumentColumns, rows: np.ndarray) -> MicroBatch:
    count = len(rows)
    lengths = columns.lengths[rows]
    positions = token_positions(columns.offsets[rows], lengths)
    # Right padding in row-major order: the True positions of attention_mask, read row by row, are the flat order.
    attention_mask = np.arange(int(lengths.max()), dtype=np.int64)[None, :] < lengths[:, None]
    input_ids = np.zeros(attention_mask.shape, dtype=np.int64)
    input_ids[attention_mask] = columns.tokens[positions]
    versions = columns.model_version[positions]
    versioned = bool(columns.versioned[rows].all())
    rewards = columns.rewards[rows]
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        lengths=torch.from_numpy(lengths),
        document_index=torch.from_numpy(np.repeat(np.arange(count, dtype=np.int64), lengths)),
        label_mask=torch.from_numpy(columns.label_mask[positions]),
        old_logprobs=torch.from_numpy(columns.old_log_probabilities[positions]),
        advantages=torch.from_numpy(np.repeat(columns.advantages[rows].astype(np.float32), lengths)),
        model_version=torch.from_numpy(versions) if versioned else None,
        rewards=None if np.isnan(rewards).any() else torch.from_numpy(rewards.astype(np.float32)),
        source_indices=tuple(rows.tolist()),
    )
