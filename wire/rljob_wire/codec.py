"""Wire format of one stream entry = one document (DESIGN §3), byte-compatible with Fast-LLM and PipelineRL.

An entry is a flat Redis hash of byte strings:

============================  ==============================================================================
field                         encoding
============================  ==============================================================================
``tokens``                    raw little-endian int64 (``np.ndarray.tobytes()``), T values: prompt + completion
``old_log_probabilities``     raw little-endian float32, T values: log p(tokens[t] | tokens[<t]) under the
                              sampling policy at the sampling temperature; 0 on prompt tokens and at t = 0
``model_version``             raw little-endian int64, T values (optional): weights version each token was
                              sampled with, in documents-seen units
``data``                      JSON object (optional): ``loss_masking_spans`` ([[begin, end), ...] half-open),
                              ``advantage`` (float, per document), ``reward`` (float, raw, per document)
============================  ==============================================================================

Upstream variants that decode accepts as well (Fast-LLM's ``RedisDocument.from_message`` merges the keys of
``data`` into the top level, and PipelineRL writers send JSON lists):

* any of ``tokens`` / ``old_log_probabilities`` / ``model_version`` as a JSON list inside ``data``;
* any of them as a top-level field whose value is a JSON list (``b"[1, 2, 3]"``);
* ``loss_masking_spans`` / ``advantage`` / ``reward`` as a top-level field holding JSON.

A top-level value that starts with ``[`` and parses as JSON is taken as a JSON list, otherwise as raw bytes.
Raw bytes can only parse as JSON if every byte is printable ASCII, i.e. int64 token ids >= 2^61 or positive
float32 log-probabilities, neither of which a sampler produces. Unknown fields (for example
Fast-LLM's ``chosen_span`` / ``rejected_span``) are ignored.

Which tokens are labelled (trained on) follows Fast-LLM: see :mod:`rljob_wire.documents`.

This module is longer than most because it holds both ends of the one wire format and its two decoders, which must
agree byte for byte: the batch decoder for the layout :func:`encode_document` writes (a batch of entries into
:class:`~rljob_wire.documents.DocumentColumns`) and the full parser that accepts every upstream variant and names
what is wrong.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import orjson

from rljob_wire.documents import (  # Document and label_masks: imported from here by the roles
    NO_VERSION,
    Document,
    DocumentColumns,
    label_masks,
    span_label_mask,
    token_positions,
)

TOKENS = "tokens"
OLD_LOG_PROBABILITIES = "old_log_probabilities"
MODEL_VERSION = "model_version"
DATA = "data"
LOSS_MASKING_SPANS = "loss_masking_spans"
ADVANTAGE = "advantage"
REWARD = "reward"

_TOKEN_DTYPE = np.dtype("<i8")
_LOGPROB_DTYPE = np.dtype("<f4")


class MalformedKind(enum.StrEnum):
    """Why an entry was rejected; the value labels the dead-letter counter."""

    MISSING_FIELD = "missing_field"
    """``tokens`` or ``old_log_probabilities`` absent, ``advantage`` absent when required, or ``model_version`` absent
    while ``algorithm.maxStaleness`` is set (the reader's check)."""
    MISSING_METRICS_FIELD = "missing_metrics_field"
    """``reward`` or ``model_version`` absent while metrics are on (DESIGN §4)."""
    LENGTH_MISMATCH = "length_mismatch"
    """A per-token field does not have T values."""
    BAD_DTYPE_SIZE = "bad_dtype_size"
    """A raw field's byte length is not a multiple of its element size (8 for int64, 4 for float32)."""
    BAD_SPAN = "bad_span"
    """A loss-masking span is not ``[begin, end]`` with ``0 <= begin <= end <= T``."""
    NON_FINITE = "non_finite"
    """NaN or infinity in ``old_log_probabilities``, ``advantage`` or ``reward``, or an ``advantage`` or ``reward``
    beyond float32's range (the trainer's tensors hold them in float32)."""
    BAD_JSON = "bad_json"
    """``data`` (or a JSON-valued field) is not valid JSON of the expected shape."""
    BAD_VALUE = "bad_value"
    """Wrong JSON type, empty or negative or out-of-vocabulary tokens, negative model version, a field given
    twice (top level and inside ``data``)."""
    TOO_LONG = "too_long"
    """More than ``max_tokens`` tokens (:class:`DocumentTooLong`; dropped and counted, not dead-lettered)."""


class MalformedEntry(ValueError):
    """A stream entry that cannot become a :class:`Document`.

    Attributes:
        reason: human-readable, names the field and the offending numbers.
        kind: a :class:`MalformedKind` value.
    """

    def __init__(self, reason: str, kind: str):
        super().__init__(f"{kind}: {reason}")
        self.reason = reason
        self.kind = str(kind)


class DocumentTooLong(MalformedEntry):
    """The document has more tokens than the micro-batch budget (DESIGN §3: dropped and counted, never truncated)."""

    def __init__(self, num_tokens: int, max_tokens: int):
        super().__init__(f"{num_tokens} tokens > micro-batch budget of {max_tokens} tokens", MalformedKind.TOO_LONG)
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


def encode_document(doc: Document) -> dict[str, bytes]:
    """Encode a document as the field→value mapping of one XADD (the layout in the module docstring).

    ``data`` is ``json.dumps`` with default separators, as Fast-LLM's ``RedisDocument.to_message`` writes it;
    it holds only the keys that are set (no ``loss_masking_spans`` key for an empty list), and is left out
    when empty.

    Raises:
        ValueError: a per-token array is not 1-D with T values (names the field and both lengths).
    """
    num_tokens = len(doc.tokens)
    message = {TOKENS: _to_bytes(TOKENS, doc.tokens, _TOKEN_DTYPE, num_tokens)}
    message[OLD_LOG_PROBABILITIES] = _to_bytes(
        OLD_LOG_PROBABILITIES, doc.old_log_probabilities, _LOGPROB_DTYPE, num_tokens
    )
    if doc.model_version is not None:
        message[MODEL_VERSION] = _to_bytes(MODEL_VERSION, doc.model_version, _TOKEN_DTYPE, num_tokens)
    data: dict[str, Any] = {}
    if doc.loss_masking_spans:
        data[LOSS_MASKING_SPANS] = [[int(begin), int(end)] for begin, end in doc.loss_masking_spans]
    if doc.advantage is not None:
        data[ADVANTAGE] = float(doc.advantage)
    if doc.reward is not None:
        data[REWARD] = float(doc.reward)
    if data:
        message[DATA] = json.dumps(data).encode()
    return message


def _to_bytes(name: str, values: np.ndarray, dtype: np.dtype, num_tokens: int) -> bytes:
    array = np.asarray(values)
    if array.ndim != 1 or len(array) != num_tokens:
        raise ValueError(f"{name}: expected shape [{num_tokens}] (as tokens), got {list(array.shape)}")
    return array.astype(dtype, copy=False).tobytes()


def decode_entry(
    fields: Mapping[bytes, bytes],
    *,
    require_metrics_fields: bool,
    max_tokens: Optional[int],
    require_advantage: bool = True,
    vocab_size: Optional[int] = None,
) -> Document:
    """Decode and validate one stream entry (XREADGROUP's field→value dict, bytes keys and values).

    Args:
        fields: the entry's fields; str keys are accepted too.
        require_metrics_fields: metrics are on, so ``reward`` and ``model_version`` must be present.
        max_tokens: micro-batch token budget; a longer document raises :class:`DocumentTooLong`. None: no limit.
        require_advantage: ``advantage`` must be present (the RL losses need it).
        vocab_size: if given, every token id must be below it (an id out of range would crash the embedding).

    Returns:
        The :class:`Document`; per-token arrays are read-only views of the field bytes when sent raw.

    Raises:
        DocumentTooLong: more than ``max_tokens`` tokens.
        MalformedEntry: anything else wrong; ``kind`` is a :class:`MalformedKind` value, ``reason`` names the
            field and the numbers.
    """
    (result,) = decode_entries(
        [fields],
        require_metrics_fields=require_metrics_fields,
        max_tokens=max_tokens,
        require_advantage=require_advantage,
        vocab_size=vocab_size,
    )
    if isinstance(result, MalformedEntry):
        raise result
    return result


def decode_entries(
    entries: Sequence[Mapping[bytes, bytes]],
    *,
    require_metrics_fields: bool,
    max_tokens: Optional[int],
    require_advantage: bool = True,
    vocab_size: Optional[int] = None,
) -> list[Document | MalformedEntry]:
    """:func:`decode_entry` over a batch of entries, one result per entry, in order (:func:`decode_columns`, one
    :class:`Document` per valid entry).

    Returns:
        For each entry its :class:`Document`, or the :class:`MalformedEntry` (or :class:`DocumentTooLong`)
        that :func:`decode_entry` would raise. Never raises for a bad entry.
    """
    columns, rows, errors = decode_columns(
        entries,
        require_metrics_fields=require_metrics_fields,
        max_tokens=max_tokens,
        require_advantage=require_advantage,
        vocab_size=vocab_size,
    )
    results: list[Any] = [None] * len(entries)
    for index, document in zip(rows.tolist(), columns.documents(), strict=True):
        results[index] = document
    for index, error in errors.items():
        results[index] = error
    return results


def decode_columns(
    entries: Sequence[Mapping[bytes, bytes]],
    *,
    require_metrics_fields: bool,
    max_tokens: Optional[int],
    require_advantage: bool = True,
    vocab_size: Optional[int] = None,
) -> tuple[DocumentColumns, np.ndarray, dict[int, MalformedEntry]]:
    """Decode and validate a batch of stream entries (the reader's hot path) into columns.

    Entries in the layout :func:`encode_document` writes are decoded together, a few numpy calls per field over the
    batch (:func:`_common_columns`); every other entry, including every malformed one, goes through the full parser,
    which accepts the upstream variants and names what is wrong. The arguments are :func:`decode_entry`'s.

    Returns:
        (the valid entries' documents, in entry order; [N] int64, the index in ``entries`` of each; the error
        :func:`decode_entry` would raise for each other entry, by index). Never raises for a bad entry.
    """
    checks = _CommonChecks(math.inf if max_tokens is None else max_tokens * _TOKEN_DTYPE.itemsize,
                           require_metrics_fields, require_advantage, vocab_size)
    parts, rest, errors = _decode_common_layout(entries, checks)
    parsed = []
    for index in sorted(rest):
        try:
            parsed.append((index, _parse(entries[index], require_metrics_fields, max_tokens, require_advantage)))
        except MalformedEntry as error:
            errors[index] = error
    if parsed:
        parts.append(_without_bad_values(np.array([index for index, _ in parsed], dtype=np.int64),
                                         DocumentColumns.from_documents([document for _, document in parsed]),
                                         vocab_size, errors))
    if len(parts) == 1:
        return parts[0][1], parts[0][0], errors
    rows = np.concatenate([part_rows for part_rows, _ in parts] or [np.zeros(0, dtype=np.int64)])
    order = np.argsort(rows, kind="stable")
    return DocumentColumns.concatenate([columns for _, columns in parts]).take(order), rows[order], errors


_B_FIELDS = tuple(name.encode() for name in (TOKENS, OLD_LOG_PROBABILITIES, MODEL_VERSION, DATA))
_COMMON_DATA_KEYS = frozenset((LOSS_MASKING_SPANS, ADVANTAGE, REWARD))
_COMMON_TYPES = (*[frozenset((bytes, bytearray))] * 3, frozenset((bytes, bytearray, memoryview)))
"""The value types the batch path takes, per field of :data:`_B_FIELDS` (redis-py returns bytes)."""
_JSON_LAST_BYTES = np.isin(np.arange(256), np.frombuffer(b"] \t\n\r", dtype=np.uint8))
"""[256] bool, True for the bytes a JSON list can end with (``]`` or trailing whitespace): raw bytes that start with
``[`` but end otherwise cannot parse as JSON, so they are raw without trying."""


@dataclass(frozen=True)
class _CommonChecks:
    max_bytes: float
    require_metrics_fields: bool
    require_advantage: bool
    vocab_size: Optional[int]


def _decode_common_layout(entries: Sequence[Mapping[bytes, bytes]], checks: _CommonChecks
                          ) -> tuple[list[tuple[np.ndarray, DocumentColumns]], list[int], dict[int, MalformedEntry]]:
    """The entries in the layout :func:`encode_document` writes, decoded: ((rows, columns) pairs, the indices of the
    entries left to the full parser, the value errors by index)."""
    values = [[fields.get(name, b"") for fields in entries] for name in _B_FIELDS]
    parts: list[tuple[np.ndarray, DocumentColumns]] = []
    rest: list[int] = []
    errors: dict[int, MalformedEntry] = {}
    common = _common_rows(entries, values, checks.max_bytes, checks.require_metrics_fields)
    _decode_common(values, common, checks, parts, rest, errors)
    if len(common) < len(entries):
        rest.extend(np.setdiff1d(np.arange(len(entries)), common, assume_unique=True).tolist())
    return parts, rest, errors


def _common_rows(entries: Sequence[Mapping[bytes, bytes]], values: list[list[bytes]], max_bytes: float,
                 require_metrics_fields: bool) -> np.ndarray:
    """[K] int64, ascending: the entries whose fields are in the common layout by name, type and byte length.

    That is exactly ``tokens`` and ``old_log_probabilities``, optionally ``model_version`` (absent only while metrics
    are off) and ``data``: bytes (or bytearray; ``data`` also a memoryview); 0 < T <= ``max_bytes`` / 8 tokens; T
    values in each per-token field."""
    count = len(entries)
    sizes = []
    for column, allowed in zip(values, _COMMON_TYPES, strict=True):
        if set(map(type, column)) <= {bytes}:
            sizes.append(np.fromiter(map(len, column), dtype=np.int64, count=count))
        else:
            sizes.append(np.fromiter((len(v) if type(v) in allowed else -1 for v in column), dtype=np.int64,
                                     count=count))
    tokens, logprobs, versions, data = sizes
    has_version, has_data = versions > 0, data > 0
    ok = (
        (np.fromiter(map(len, entries), dtype=np.int64, count=count) == 2 + has_version + has_data)
        & (tokens > 0) & (tokens <= max_bytes) & (tokens % _TOKEN_DTYPE.itemsize == 0)
        & (logprobs * 2 == tokens)  # float32 vs int64: same T
        & (np.where(has_version, versions == tokens, not require_metrics_fields))
        & (data >= 0)
    )
    return np.flatnonzero(ok)


def _decode_common(values: list[list[bytes]], rows: np.ndarray, checks: _CommonChecks,
                   parts: list[tuple[np.ndarray, DocumentColumns]], rest: list[int],
                   errors: dict[int, MalformedEntry]) -> None:
    """Decode the common-layout entries at ``rows`` into ``parts`` ((rows, columns) pairs), their value errors into
    ``errors``; a batch that does not pass :func:`_common_columns` is split in halves, down to single entries, and a
    single entry that does not goes to ``rest`` for the full parser."""
    if not len(rows):
        return
    decoded = _common_columns(values, rows, checks, errors)
    if decoded is not None:
        parts.append(decoded)
    elif len(rows) == 1:
        rest.append(int(rows[0]))
    else:
        middle = len(rows) // 2
        _decode_common(values, rows[:middle], checks, parts, rest, errors)
        _decode_common(values, rows[middle:], checks, parts, rest, errors)


def _rows_of(column: list[bytes], rows: np.ndarray) -> list[bytes]:
    return column if len(rows) == len(column) else [column[row] for row in rows.tolist()]


def _common_columns(values: list[list[bytes]], rows: np.ndarray, checks: _CommonChecks,
                    errors: dict[int, MalformedEntry]) -> Optional[tuple[np.ndarray, DocumentColumns]]:
    """The entries at ``rows`` (common layout by :func:`_common_rows`) as columns, or None when one of them is not
    in the common layout after all: a per-token field that may be a JSON list, or ``data`` that is not a JSON object
    holding only ``loss_masking_spans`` as in-range integer ``[begin, end]`` pairs and ``advantage`` / ``reward`` as
    finite numbers (present when required; integers are taken as floats, as the full parser takes them).

    ``data`` is parsed with orjson (strict RFC 8259, about 4x faster than the standard library here); what it
    refuses but the standard library accepts (``NaN``, ``Infinity``, lone surrogates) is left to the full parser, and
    an integer beyond 64 bits, which orjson reads as a float, is a float here too (a scalar: the value the full parser
    takes; a span bound: not an integer, so the full parser names it), so the outcome is the same. The per-token values are checked over the whole batch
    (token ids in range, finite log-probabilities, non-negative model versions); an entry that fails goes into
    ``errors`` with :func:`_check_values`' message, and out of the returned rows.
    """
    tokens_column, logprobs_column, versions_column, data_column = (_rows_of(column, rows) for column in values)
    count = len(rows)
    lengths = np.fromiter(map(len, tokens_column), np.int64, count) // _TOKEN_DTYPE.itemsize
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.frombuffer(b"".join(tokens_column), dtype=_TOKEN_DTYPE)
    logprobs = np.frombuffer(b"".join(logprobs_column), dtype=_LOGPROB_DTYPE)
    has_version = np.fromiter(map(len, versions_column), np.int64, count) > 0
    if has_version.all():
        versions = np.frombuffer(b"".join(versions_column), dtype=_TOKEN_DTYPE)
    else:
        versions = np.full(len(tokens), NO_VERSION, dtype=np.int64)  # absent ones are b"" in the join
        versions[token_positions(offsets[:-1][has_version], lengths[has_version])] = np.frombuffer(
            b"".join(versions_column), dtype=_TOKEN_DTYPE)
    starts, ends = offsets[:-1], offsets[1:] - 1
    for array, present in ((tokens, None), (logprobs, None), (versions, has_version)):
        raw = array.view(np.uint8).reshape(-1, array.itemsize)
        maybe_json = (raw[starts, 0] == ord("[")) & _JSON_LAST_BYTES[raw[ends, -1]]
        if (maybe_json if present is None else maybe_json & present).any():
            return None
    data = _common_data(data_column, lengths, checks)
    if data is None:
        return None
    advantages, rewards, spans, span_offsets = data
    columns = DocumentColumns(
        tokens=tokens,
        old_log_probabilities=logprobs,
        model_version=versions,
        versioned=has_version,
        label_mask=span_label_mask(lengths, spans, np.diff(span_offsets)),
        offsets=offsets,
        advantages=advantages,
        rewards=rewards,
        spans=spans,
        span_offsets=span_offsets,
    )
    return _without_bad_values(rows, columns, checks.vocab_size, errors)


def _without_bad_values(rows: np.ndarray, columns: DocumentColumns, vocab_size: Optional[int],
                        errors: dict[int, MalformedEntry]) -> tuple[np.ndarray, DocumentColumns]:
    """``rows`` and ``columns`` without the documents whose values fail :func:`_check_values`, checked over the
    whole batch at once (:func:`_bad_documents`) and document by document only when that fails; each failure goes
    into ``errors`` at its row."""
    bad = _bad_documents(columns, vocab_size)
    if bad is None:
        return rows, columns
    for row, index in zip(rows[bad].tolist(), np.flatnonzero(bad).tolist()):
        try:
            _check_values(columns.document(index), vocab_size)
        except MalformedEntry as error:
            errors[row] = error
    return rows[~bad], columns.take(~bad)


def _common_data(data_column: list[bytes], lengths: np.ndarray, checks: _CommonChecks
                 ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The ``data`` of N entries (b"" where absent) as (advantages [N] float64, rewards [N] float64, NaN where absent;
    spans [S, 2] int64; span offsets [N + 1] int64), or None when one is not in the common layout (see
    :func:`_common_columns`)."""
    try:
        parsed = [orjson.loads(value) if value else _NO_DATA for value in data_column]
    except orjson.JSONDecodeError:
        return None
    if not set(map(type, parsed)) <= {dict} or not set().union(*parsed) <= _COMMON_DATA_KEYS:
        return None
    scalars = []
    for name, required in ((ADVANTAGE, checks.require_advantage), (REWARD, checks.require_metrics_fields)):
        column = list(map(dict.get, parsed, itertools.repeat(name)))
        if not set(map(type, column)) <= ({float, int} if required else {float, int, type(None)}):
            return None
        try:
            array = np.array([math.nan if value is None else value for value in column], dtype=np.float64)
        except OverflowError:  # an integer beyond the float range: the parser names it
            return None
        if (np.abs(array) > _FLOAT32_MAX).any():  # infinite, or so once trained in float32: the parser names it
            return None
        scalars.append(array)
    spans = [_NO_SPANS if span is None else span
             for span in map(dict.get, parsed, itertools.repeat(LOSS_MASKING_SPANS))]
    if not set(map(type, spans)) <= {list}:
        return None
    pairs = list(itertools.chain.from_iterable(spans))
    if not set(map(type, pairs)) <= {list} or not set(map(len, pairs)) <= {2}:
        return None
    bounds = list(itertools.chain.from_iterable(pairs))
    if not set(map(type, bounds)) <= {int}:
        return None
    try:
        span_array = np.array(bounds, dtype=np.int64).reshape(-1, 2)
    except OverflowError:
        return None
    span_counts = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
    limits = np.repeat(lengths, span_counts)
    if ((span_array[:, 0] < 0) | (span_array[:, 0] > span_array[:, 1]) | (span_array[:, 1] > limits)).any():
        return None
    span_offsets = np.zeros(len(spans) + 1, dtype=np.int64)
    np.cumsum(span_counts, out=span_offsets[1:])
    return scalars[0], scalars[1], span_array, span_offsets


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NO_DATA: dict[str, Any] = {}
_NO_SPANS: list[Any] = []
_INT64_LIMIT = 2**63


def _bad_documents(columns: DocumentColumns, vocab_size: Optional[int]) -> Optional[np.ndarray]:
    """None when every document's values pass :func:`_check_values`, else [N] bool, True for each that fails. Viewed
    as uint64, a negative int64 is >= 2^63, so one maximum checks both bounds."""
    token_limit = _INT64_LIMIT if vocab_size is None else min(vocab_size, _INT64_LIMIT)
    lengths = columns.lengths
    carried = None if columns.versioned.all() else np.repeat(columns.versioned, lengths)
    versions = columns.model_version if carried is None else columns.model_version[carried]
    if (
        int(columns.tokens.view(np.uint64).max(initial=0)) < token_limit
        and np.isfinite(columns.old_log_probabilities).all()
        and int(versions.view(np.uint64).max(initial=0)) < _INT64_LIMIT
    ):
        return None
    negative_version = columns.model_version < 0
    bad_tokens = (
        (columns.tokens.view(np.uint64) >= token_limit)
        | ~np.isfinite(columns.old_log_probabilities)
        | (negative_version if carried is None else negative_version & carried)
    )
    return np.logical_or.reduceat(bad_tokens, columns.offsets[:-1])


def _parse(
    fields: Mapping[bytes, bytes], require_metrics_fields: bool, max_tokens: Optional[int], require_advantage: bool
) -> Document:
    """Everything but the per-token value checks: presence, JSON, byte sizes, lengths, scalars, spans."""
    values = _merge_data(fields)
    if TOKENS not in values:
        raise MalformedEntry("no `tokens` field", MalformedKind.MISSING_FIELD)
    tokens = _array(TOKENS, values[TOKENS], _TOKEN_DTYPE)
    num_tokens = len(tokens)
    if num_tokens == 0:
        raise MalformedEntry("`tokens` is empty", MalformedKind.BAD_VALUE)
    if max_tokens is not None and num_tokens > max_tokens:
        raise DocumentTooLong(num_tokens, max_tokens)

    if OLD_LOG_PROBABILITIES not in values:
        raise MalformedEntry("no `old_log_probabilities` field", MalformedKind.MISSING_FIELD)
    old_log_probabilities = _array(OLD_LOG_PROBABILITIES, values[OLD_LOG_PROBABILITIES], _LOGPROB_DTYPE)
    _check_length(OLD_LOG_PROBABILITIES, old_log_probabilities, num_tokens)

    model_version = None
    if MODEL_VERSION in values:
        model_version = _array(MODEL_VERSION, values[MODEL_VERSION], _TOKEN_DTYPE)
        _check_length(MODEL_VERSION, model_version, num_tokens)
    elif require_metrics_fields:
        raise MalformedEntry("no `model_version` field while metrics are on", MalformedKind.MISSING_METRICS_FIELD)

    advantage = _scalar(ADVANTAGE, values.get(ADVANTAGE))
    if advantage is None and require_advantage:
        raise MalformedEntry("no `advantage` in `data`", MalformedKind.MISSING_FIELD)
    reward = _scalar(REWARD, values.get(REWARD))
    if reward is None and require_metrics_fields:
        raise MalformedEntry("no `reward` in `data` while metrics are on", MalformedKind.MISSING_METRICS_FIELD)

    spans = _spans(values.get(LOSS_MASKING_SPANS), num_tokens)
    return Document(tokens, old_log_probabilities, model_version, spans, advantage, reward)


def _check_values(doc: Document, vocab_size: Optional[int]) -> None:
    """The per-document form of :func:`_bad_documents`, raising the first problem with its numbers."""
    low, high = int(doc.tokens.min()), int(doc.tokens.max())
    if low < 0:
        raise MalformedEntry(f"`tokens` holds a negative id ({low})", MalformedKind.BAD_VALUE)
    if vocab_size is not None and high >= vocab_size:
        raise MalformedEntry(f"`tokens` holds id {high} >= vocabulary size {vocab_size}", MalformedKind.BAD_VALUE)
    finite = np.isfinite(doc.old_log_probabilities)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise MalformedEntry(
            f"`old_log_probabilities[{bad}]` = {doc.old_log_probabilities[bad]} is not finite", MalformedKind.NON_FINITE
        )
    if doc.model_version is not None and int(doc.model_version.min()) < 0:
        raise MalformedEntry(f"`model_version` holds {int(doc.model_version.min())} < 0", MalformedKind.BAD_VALUE)


_NAMES = {
    name.encode(): name
    for name in (TOKENS, OLD_LOG_PROBABILITIES, MODEL_VERSION, DATA, LOSS_MASKING_SPANS, ADVANTAGE, REWARD)
}


def _merge_data(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    """Top-level fields (bytes values) plus the keys of ``data`` (parsed JSON values), refusing duplicates."""
    values: dict[str, Any] = {}
    for key, value in fields.items():
        name = _NAMES.get(key)
        if name is None:
            try:
                name = key.decode() if isinstance(key, bytes) else str(key)
            except UnicodeDecodeError:
                raise MalformedEntry(f"field name {key[:40]!r} is not UTF-8", MalformedKind.BAD_VALUE) from None
        values[name] = value
    data = values.pop(DATA, None)
    if data is not None:
        data = _json(DATA, data)
        if not isinstance(data, dict):
            raise MalformedEntry(f"`data` is a JSON {type(data).__name__}, not an object", MalformedKind.BAD_JSON)
        clash = values.keys() & data.keys()
        if clash:
            raise MalformedEntry(f"`{min(clash)}` given both as a field and inside `data`", MalformedKind.BAD_VALUE)
        values.update(data)
    return values


_JSON = json.JSONDecoder()


def _loads(value: bytes | str) -> Any:
    """``json.loads`` without its per-call overhead. Raises ValueError (JSON or UTF-8 error, or nesting too deep
    for the parser's recursion)."""
    try:
        return _JSON.decode(value.decode() if isinstance(value, bytes) else value)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json(name: str, value: Any) -> Any:
    try:
        return _loads(value)
    except (ValueError, TypeError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MalformedEntry(f"`{name}` is not valid JSON ({error})", MalformedKind.BAD_JSON) from None


def _array(name: str, value: Any, dtype: np.dtype) -> np.ndarray:
    """A per-token field as a 1-D array of ``dtype``: raw bytes → zero-copy view; JSON list → new array."""
    if isinstance(value, bytes):
        if value.startswith(b"["):
            try:
                value = _loads(value)
            except ValueError:
                pass  # raw bytes that happen to start with 0x5B
        if isinstance(value, bytes):
            if len(value) % dtype.itemsize:
                raise MalformedEntry(
                    f"`{name}` has {len(value)} bytes, not a multiple of {dtype.itemsize} ({dtype.name})",
                    MalformedKind.BAD_DTYPE_SIZE,
                )
            return np.frombuffer(value, dtype=dtype)
    if not isinstance(value, list):
        raise MalformedEntry(f"`{name}` is a JSON {type(value).__name__}, not a list", MalformedKind.BAD_VALUE)
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as error:
        raise MalformedEntry(f"`{name}` is not a flat list of numbers ({error})", MalformedKind.BAD_VALUE) from None
    allowed = "iu" if dtype.kind == "i" else "iuf"
    if array.ndim != 1 or (array.size and array.dtype.kind not in allowed):
        what = "integers" if dtype.kind == "i" else "numbers"
        raise MalformedEntry(
            f"`{name}` is not a flat list of {what} (numpy dtype {array.dtype})", MalformedKind.BAD_VALUE
        )
    if dtype.kind == "i" and array.size and array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
        raise MalformedEntry(f"`{name}` holds a value above the int64 range", MalformedKind.BAD_VALUE)
    return array.astype(dtype)


def _check_length(name: str, array: np.ndarray, num_tokens: int) -> None:
    if len(array) != num_tokens:
        raise MalformedEntry(
            f"`{name}` has {len(array)} values, `tokens` has {num_tokens}", MalformedKind.LENGTH_MISMATCH
        )


def _scalar(name: str, value: Any) -> Optional[float]:
    """A per-document float (``advantage``, ``reward``); bytes values are top-level fields holding JSON."""
    if isinstance(value, bytes):
        value = _json(name, value)
    if value is None:
        return None
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, int)):
        raise MalformedEntry(f"`{name}` is a JSON {type(value).__name__}, not a number", MalformedKind.BAD_VALUE)
    try:
        number = float(value)
    except OverflowError:  # a JSON integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise MalformedEntry(f"`{name}` = {number} is not finite", MalformedKind.NON_FINITE)
    if abs(number) > _FLOAT32_MAX:
        raise MalformedEntry(f"`{name}` = {number} is beyond float32's range (the loss and the metrics would see "
                             "infinity)", MalformedKind.NON_FINITE)
    return number


def _spans(value: Any, num_tokens: int) -> list[tuple[int, int]]:
    if isinstance(value, bytes):
        value = _json(LOSS_MASKING_SPANS, value)
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedEntry(
            f"`loss_masking_spans` is a JSON {type(value).__name__}, not a list", MalformedKind.BAD_SPAN
        )
    spans = []
    for index, span in enumerate(value):
        if not (isinstance(span, list) and len(span) == 2 and type(span[0]) is int and type(span[1]) is int):
            raise MalformedEntry(
                f"`loss_masking_spans[{index}]` = {span!r} is not [begin, end]", MalformedKind.BAD_SPAN
            )
        begin, end = span
        if not 0 <= begin <= end <= num_tokens:
            raise MalformedEntry(
                f"`loss_masking_spans[{index}]` = [{begin}, {end}) is inverted or outside [0, {num_tokens}]",
                MalformedKind.BAD_SPAN,
            )
        spans.append((begin, end))
    return spans
