"""Decoded documents, one at a time (:class:`Document`) or a batch as columns (:class:`DocumentColumns`).

The codec (:mod:`rljob_wire.codec`) decodes stream entries into columns: one array per per-token field over the
documents' tokens laid end to end, one per per-document field, so the reader and the trainer's packer touch a step's
documents with a few numpy calls instead of a Python object and several calls per document. :class:`Document` is
the same data for one document (what a writer encodes, what tests build).

Label semantics (Fast-LLM's ``LanguageModelBatch._set_target_inputs``): the label at position t is ``tokens[t]``,
predicted from ``tokens[<t]``. Position 0 has no prediction, and a span ``(begin, end)`` masks the labels
``tokens[begin:end]`` (for example the prompt). So the labelled tokens of a document are the positions ``1 <= t < T``
outside every span; see :func:`label_masks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

NO_VERSION = -1
""":attr:`DocumentColumns.model_version` of the tokens of a document without ``model_version`` (which
:attr:`DocumentColumns.versioned` says; the codec refuses negative versions)."""


@dataclass(eq=False)
class Document:
    """One sampled completion with its prompt, as carried by one stream entry.

    Attributes:
        tokens: [T] int64, prompt + completion token ids.
        old_log_probabilities: [T] float32, ``log p(tokens[t] | tokens[<t])`` under the sampling policy at the
            sampling temperature; 0 where there is no label (t = 0, prompt).
        model_version: [T] int64 or None, the weights version (documents seen) each token was sampled with.
        loss_masking_spans: half-open ``(begin, end)`` token ranges whose labels are masked.
        advantage: per-document advantage, broadcast to every token; None if the writer sent none.
        reward: raw (un-normalised) per-document reward, for metrics only; None if the writer sent none.
    """

    tokens: np.ndarray
    old_log_probabilities: np.ndarray
    model_version: Optional[np.ndarray] = None
    loss_masking_spans: list[tuple[int, int]] = field(default_factory=list)
    advantage: Optional[float] = None
    reward: Optional[float] = None

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens (prompt + completion)."""
        return len(self.tokens)

    def label_mask(self) -> np.ndarray:
        """[T] bool: True on labelled tokens (positions 1..T-1 outside every loss-masking span); see
        :func:`label_masks`."""
        return label_masks([self])


def label_masks(docs: Sequence[Document]) -> np.ndarray:
    """The label masks of ``docs``, concatenated: [sum of T] bool, True on labelled tokens.

    Matches Fast-LLM (``LanguageModelBatch._set_target_inputs``): labels = tokens, ``labels[begin:end]``
    masked for each loss-masking span, and the first label of each document masked (it has no prediction).
    """
    lengths = np.fromiter((len(doc.tokens) for doc in docs), dtype=np.int64, count=len(docs))
    spans = [span for doc in docs for span in doc.loss_masking_spans]
    span_counts = np.fromiter((len(doc.loss_masking_spans) for doc in docs), dtype=np.int64, count=len(docs))
    return span_label_mask(lengths, np.asarray(spans, dtype=np.int64).reshape(-1, 2), span_counts)


def span_label_mask(lengths: np.ndarray, spans: np.ndarray, span_counts: np.ndarray) -> np.ndarray:
    """The concatenated label masks of documents given by their lengths and spans (see :func:`label_masks`).

    Args:
        lengths: [N] int64, tokens per document.
        spans: [S, 2] int64, every document's ``(begin, end)`` spans in document order, each within its document.
        span_counts: [N] int64, spans per document (summing to S).

    Returns:
        [sum of lengths] bool, False at each document's first position and inside its spans.
    """
    starts = _offsets(lengths)[:-1]
    total = int(lengths.sum())
    firsts = starts[lengths > 0]
    offset = np.repeat(starts, span_counts)
    begins = np.concatenate([firsts, offset + spans[:, 0]])
    ends = np.concatenate([firsts + 1, offset + spans[:, 1]])
    # The masked positions as disjoint runs: overlapping or touching intervals merged (sorted by begin, a run ends
    # where the next begin lies beyond every end so far), then True/False runs laid out with one np.repeat.
    order = np.argsort(begins, kind="stable")
    begins, reach = begins[order], np.maximum.accumulate(ends[order])
    opens = np.ones(len(begins), dtype=bool)
    opens[1:] = begins[1:] > reach[:-1]
    run_begins = begins[opens]
    run_ends = reach[np.append(np.flatnonzero(opens)[1:] - 1, len(begins) - 1)] if len(begins) else run_begins
    bounds = np.empty(2 * len(run_begins) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, total
    bounds[1:-1:2], bounds[2:-1:2] = run_begins, run_ends
    labelled = np.ones(len(bounds) - 1, dtype=bool)
    labelled[1::2] = False
    return np.repeat(labelled, np.diff(bounds))


@dataclass(eq=False)
class DocumentColumns:
    """N decoded documents as columns; T is their total number of tokens (document i's tokens are
    ``tokens[offsets[i]:offsets[i + 1]]``).

    Arrays decoded from the wire may be read-only; none is modified in place.

    Attributes:
        tokens: [T] int64 token ids.
        old_log_probabilities: [T] float32 sampling log-probabilities (see :class:`Document`).
        model_version: [T] int64 documents seen per token, :data:`NO_VERSION` on the tokens of a document that
            carried none.
        versioned: [N] bool, whether each document carried ``model_version``.
        label_mask: [T] bool, True on labelled tokens (:func:`label_masks`).
        offsets: [N + 1] int64, each document's first token, then T.
        advantages: [N] float64, NaN for a document that carried none (valid ones are finite).
        rewards: [N] float64, NaN for a document that carried none (valid ones are finite).
        spans: [S, 2] int64, every document's loss-masking ``(begin, end)`` spans in document order (positions
            within the document).
        span_offsets: [N + 1] int64, each document's first span in ``spans``, then S.
    """

    tokens: np.ndarray
    old_log_probabilities: np.ndarray
    model_version: np.ndarray
    versioned: np.ndarray
    label_mask: np.ndarray
    offsets: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    spans: np.ndarray
    span_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """[N] int64, tokens per document."""
        return np.diff(self.offsets)

    def document(self, index: int) -> Document:
        """Document ``index`` as a :class:`Document` of views into the columns. Raises IndexError out of range."""
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        begin, end = int(self.offsets[index]), int(self.offsets[index + 1])
        versions = self.model_version[begin:end]
        advantage, reward = float(self.advantages[index]), float(self.rewards[index])
        return Document(
            tokens=self.tokens[begin:end],
            old_log_probabilities=self.old_log_probabilities[begin:end],
            model_version=versions if self.versioned[index] else None,
            loss_masking_spans=[
                (begin, end)
                for begin, end in self.spans[self.span_offsets[index] : self.span_offsets[index + 1]].tolist()
            ],
            advantage=None if math.isnan(advantage) else advantage,
            reward=None if math.isnan(reward) else reward,
        )

    def documents(self) -> list[Document]:
        """Every document, in order (:meth:`document`)."""
        return [self.document(index) for index in range(len(self))]

    def take(self, rows: np.ndarray) -> "DocumentColumns":
        """The documents at ``rows`` ([K] int64 indices, or [N] bool), in that order."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise IndexError(f"rows {int(rows.min())}..{int(rows.max())} outside [0, {len(self)})")
        lengths = self.lengths[rows]
        positions = token_positions(self.offsets[rows], lengths)
        span_counts = np.diff(self.span_offsets)[rows]
        return DocumentColumns(
            tokens=self.tokens[positions],
            old_log_probabilities=self.old_log_probabilities[positions],
            model_version=self.model_version[positions],
            versioned=self.versioned[rows],
            label_mask=self.label_mask[positions],
            offsets=_offsets(lengths),
            advantages=self.advantages[rows],
            rewards=self.rewards[rows],
            spans=self.spans[token_positions(self.span_offsets[rows], span_counts)],
            span_offsets=_offsets(span_counts),
        )

    def head(self, count: int) -> "DocumentColumns":
        """The first ``count`` documents (views, no copy of the per-token columns)."""
        return self._documents(0, count)

    def tail(self, count: int) -> "DocumentColumns":
        """The documents after the first ``count`` (views, no copy of the per-token columns)."""
        return self._documents(count, len(self))

    def _documents(self, first: int, end: int) -> "DocumentColumns":
        """Documents ``first`` to ``end - 1`` as views."""
        tokens = slice(int(self.offsets[first]), int(self.offsets[end]))
        spans = slice(int(self.span_offsets[first]), int(self.span_offsets[end]))
        return DocumentColumns(
            tokens=self.tokens[tokens],
            old_log_probabilities=self.old_log_probabilities[tokens],
            model_version=self.model_version[tokens],
            versioned=self.versioned[first:end],
            label_mask=self.label_mask[tokens],
            offsets=self.offsets[first : end + 1] - self.offsets[first],
            advantages=self.advantages[first:end],
            rewards=self.rewards[first:end],
            spans=self.spans[spans],
            span_offsets=self.span_offsets[first : end + 1] - self.span_offsets[first],
        )

    @classmethod
    def concatenate(cls, parts: Sequence["DocumentColumns"]) -> "DocumentColumns":
        """The documents of ``parts``, in order (the first part itself when it is the only one)."""
        parts = [part for part in parts if len(part)] or list(parts[:1]) or [cls.empty()]
        if len(parts) == 1:
            return parts[0]
        return cls(
            tokens=np.concatenate([part.tokens for part in parts]),
            old_log_probabilities=np.concatenate([part.old_log_probabilities for part in parts]),
            model_version=np.concatenate([part.model_version for part in parts]),
            versioned=np.concatenate([part.versioned for part in parts]),
            label_mask=np.concatenate([part.label_mask for part in parts]),
            offsets=_offsets(np.concatenate([part.lengths for part in parts])),
            advantages=np.concatenate([part.advantages for part in parts]),
            rewards=np.concatenate([part.rewards for part in parts]),
            spans=np.concatenate([part.spans for part in parts]),
            span_offsets=_offsets(np.concatenate([np.diff(part.span_offsets) for part in parts])),
        )

    @classmethod
    def empty(cls) -> "DocumentColumns":
        """No document."""
        return cls.from_documents([])

    @classmethod
    def from_documents(cls, docs: Sequence[Document]) -> "DocumentColumns":
        """The columns of ``docs`` (copies). Raises ValueError when a document's per-token arrays differ in length
        from its tokens (names the document and the field)."""
        lengths = np.fromiter((len(doc.tokens) for doc in docs), dtype=np.int64, count=len(docs))
        for index, doc in enumerate(docs):
            for name in ("old_log_probabilities", "model_version"):
                values = getattr(doc, name)
                if values is not None and len(values) != len(doc.tokens):
                    raise ValueError(f"docs[{index}].{name} has {len(values)} values, tokens has {len(doc.tokens)}")
        return cls(
            tokens=np.concatenate([np.asarray(doc.tokens, dtype=np.int64) for doc in docs] or [_NO_INT64]),
            old_log_probabilities=np.concatenate(
                [np.asarray(doc.old_log_probabilities, dtype=np.float32) for doc in docs] or [_NO_FLOAT32]
            ),
            model_version=np.concatenate([
                np.full(len(doc.tokens), NO_VERSION, dtype=np.int64) if doc.model_version is None
                else np.asarray(doc.model_version, dtype=np.int64) for doc in docs
            ] or [_NO_INT64]),
            versioned=np.array([doc.model_version is not None for doc in docs], dtype=bool),
            label_mask=label_masks(docs),
            offsets=_offsets(lengths),
            advantages=np.array([math.nan if doc.advantage is None else doc.advantage for doc in docs], np.float64),
            rewards=np.array([math.nan if doc.reward is None else doc.reward for doc in docs], np.float64),
            spans=np.array([span for doc in docs for span in doc.loss_masking_spans], dtype=np.int64).reshape(-1, 2),
            span_offsets=_offsets(np.fromiter((len(doc.loss_masking_spans) for doc in docs), np.int64, len(docs))),
        )

    def staleness(self, documents_seen: int) -> tuple[np.ndarray, np.ndarray]:
        """Each document's staleness at ``documents_seen`` (DESIGN §4 ``algorithm.maxStaleness``: the oldest weights
        any of its trained tokens was sampled with decide).

        Returns:
            ([N] int64 ``documents_seen`` minus the smallest ``model_version`` of the document's labelled tokens, an
            int64 difference: exact; [N] bool, False for a document without a labelled token or without
            ``model_version``, whose staleness is then 0).
        """
        oldest = np.zeros(len(self), dtype=np.int64)
        labelled = np.zeros(len(self), dtype=bool)
        nonempty = self.lengths > 0
        if nonempty.any():
            starts = self.offsets[:-1][nonempty]
            versions = np.where(self.label_mask, self.model_version, np.iinfo(np.int64).max)
            oldest[nonempty] = np.minimum.reduceat(versions, starts)
            labelled[nonempty] = np.logical_or.reduceat(self.label_mask, starts)
        known = labelled & self.versioned
        return np.where(known, int(documents_seen) - np.where(known, oldest, 0), 0), known


_NO_INT64 = np.zeros(0, dtype=np.int64)
_NO_FLOAT32 = np.zeros(0, dtype=np.float32)


def token_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum of lengths] int64: the positions ``starts[k] .. starts[k] + lengths[k] - 1`` of each run k, in order
    (the flat indices that gather runs of a column)."""
    total = int(lengths.sum())
    run_starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=run_starts[1:])
    return np.arange(total, dtype=np.int64) + np.repeat(starts - run_starts, lengths)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
