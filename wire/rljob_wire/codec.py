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

Label semantics (Fast-LLM's ``LanguageModelBatch._set_target_inputs``): the label at position t is
``tokens[t]``, predicted from ``tokens[<t]``. Position 0 has no prediction, and a span ``(begin, end)`` masks
the labels ``tokens[begin:end]`` (for example the prompt). So the labelled tokens of a document are the
positions ``1 <= t < T`` outside every span; see :meth:`Document.label_mask`.

This module is longer than most because it holds both ends of the one wire format and its two decoders, which must
agree byte for byte: the fast path for the layout :func:`encode_document` writes and the full parser that accepts
every upstream variant and names what is wrong.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import orjson

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
    """NaN or infinity in ``old_log_probabilities``, ``advantage`` or ``reward``."""
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


@dataclass(eq=False)
class Document:
    """One sampled completion with its prompt, as carried by one stream entry.

    Arrays decoded from the wire are read-only views of the entry's bytes (``np.frombuffer``).

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
    lengths = [len(doc.tokens) for doc in docs]
    mask = np.ones(sum(lengths), dtype=bool)
    start = 0
    for doc, length in zip(docs, lengths, strict=True):
        if length:
            mask[start] = False
        for begin, end in doc.loss_masking_spans:
            mask[start + begin : start + end] = False
        start += length
    return mask


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
    """:func:`decode_entry` over a batch of entries (the reader's hot path), one result per entry, in order.

    Entries in the layout :func:`encode_document` writes take a single-pass fast path
    (:func:`_decode_common_layout`); every other entry, including every malformed one, goes through the full
    parser, which names what is wrong. The per-token value checks (token ids in range, finite
    log-probabilities, non-negative model versions) run once per chunk of about :data:`_CHECK_CHUNK_TOKENS`
    tokens and are repeated entry by entry only when a chunk fails them, so numpy's per-call cost is paid per
    chunk rather than per entry.

    Returns:
        For each entry its :class:`Document`, or the :class:`MalformedEntry` (or :class:`DocumentTooLong`)
        that :func:`decode_entry` would raise. Never raises for a bad entry.
    """
    results: list[Any] = [None] * len(entries)
    _decode_common_layout(entries, results, require_metrics_fields, max_tokens, require_advantage, vocab_size)
    parsed = []
    for index, fields in enumerate(entries):
        if results[index] is None:
            try:
                results[index] = _parse(fields, require_metrics_fields, max_tokens, require_advantage)
                parsed.append(index)
            except MalformedEntry as error:
                results[index] = error
    if parsed:
        _check_documents([(index, results[index]) for index in parsed], results, vocab_size)
    return results


_CHECK_CHUNK_TOKENS = 32768
"""Tokens per vectorised value check: enough to amortise numpy's per-call cost over many short documents, few
enough that the concatenated copies stay small (in the CPU cache, and in heap memory that is reused rather
than mapped and faulted in afresh)."""
_B_TOKENS, _B_OLD_LOG_PROBABILITIES, _B_MODEL_VERSION, _B_DATA = (
    name.encode() for name in (TOKENS, OLD_LOG_PROBABILITIES, MODEL_VERSION, DATA)
)
_COMMON_DATA_KEYS = frozenset((LOSS_MASKING_SPANS, ADVANTAGE, REWARD))
_NO_DATA: dict[str, Any] = {}
_JSON_LAST_BYTES = frozenset(b"] \t\n\r")
"""The bytes a JSON list can end with (``]`` or trailing whitespace): raw bytes that start with ``[`` but end
otherwise cannot parse as JSON, so they are raw without trying."""


def _fast_scalar_ok(value: object, required: bool) -> bool:
    """The fast path's check of an optional scalar of ``data``: absent and not required, or a finite float."""
    if value is None:
        return not required
    return type(value) is float and -math.inf < value < math.inf


def _decode_common_layout(
    entries: Sequence[Mapping[bytes, bytes]],
    results: list[Any],
    require_metrics_fields: bool,
    max_tokens: Optional[int],
    require_advantage: bool,
    vocab_size: Optional[int],
) -> None:
    """Decode and check the entries in the layout :func:`encode_document` writes; leave the others alone.

    An entry qualifies when it has exactly the fields ``tokens``, ``old_log_probabilities`` (raw bytes that
    cannot be JSON), optionally ``model_version`` (raw) and ``data`` (a JSON object holding only
    ``loss_masking_spans`` as valid ``[begin, end]`` integer pairs and ``advantage`` / ``reward`` as finite
    JSON floats), with consistent lengths, at most ``max_tokens`` tokens and every required field present.
    ``data`` is parsed with orjson (strict RFC 8259, about 4x faster than the standard library here); what it
    refuses but the standard library accepts (``NaN``, ``Infinity``, lone surrogates, integers beyond 64
    bits) is left to the full parser, so the outcome is the same.

    A qualifying entry's :class:`Document` (arrays: read-only views of the field bytes), or the error of a
    failed value check (:func:`_check_documents`, per chunk of about :data:`_CHECK_CHUNK_TOKENS` tokens), goes
    into ``results[index]``. Every other entry stays None for :func:`_parse`, which accepts the other variants
    and names what is wrong: this function rejects only on values.
    """
    max_bytes = math.inf if max_tokens is None else max_tokens * _TOKEN_DTYPE.itemsize
    chunk_bytes = _CHECK_CHUNK_TOKENS * _TOKEN_DTYPE.itemsize
    chunk: list[tuple[int, Document]] = []
    chunk_size = 0
    for index, fields in enumerate(entries):
        document = _common_layout_document(fields, max_bytes, require_metrics_fields, require_advantage)
        if document is None:
            continue
        results[index] = document
        chunk.append((index, document))
        chunk_size += document.tokens.nbytes
        if chunk_size >= chunk_bytes:
            _check_documents(chunk, results, vocab_size)
            chunk, chunk_size = [], 0
    if chunk:
        _check_documents(chunk, results, vocab_size)


def _common_layout_document(fields: Mapping[bytes, bytes], max_bytes: float, require_metrics_fields: bool,
                            require_advantage: bool) -> Optional[Document]:
    """One entry as a :class:`Document` of read-only views when it is in the common layout (see
    :func:`_decode_common_layout`) with at most ``max_bytes`` bytes of tokens; None otherwise (values unchecked)."""
    try:
        token_bytes = fields[_B_TOKENS]
        logprob_bytes = fields[_B_OLD_LOG_PROBABILITIES]
        version_bytes = fields.get(_B_MODEL_VERSION)
        data = fields.get(_B_DATA)
        size = len(token_bytes)
        if (
            len(fields) != 2 + (version_bytes is not None) + (data is not None)
            or not 0 < size <= max_bytes
            or size % _TOKEN_DTYPE.itemsize
            or len(logprob_bytes) * 2 != size  # float32 vs int64: same T
            or (token_bytes.startswith(b"[") and token_bytes[-1] in _JSON_LAST_BYTES)
            or (logprob_bytes.startswith(b"[") and logprob_bytes[-1] in _JSON_LAST_BYTES)
        ):
            return None
        if version_bytes is None:
            if require_metrics_fields:
                return None
        elif len(version_bytes) != size or (version_bytes.startswith(b"[") and version_bytes[-1] in _JSON_LAST_BYTES):
            return None
        values = _NO_DATA if data is None else orjson.loads(data)
        if data is not None and (type(values) is not dict or not values.keys() <= _COMMON_DATA_KEYS):
            return None
        advantage, reward = values.get(ADVANTAGE), values.get(REWARD)
        if not (_fast_scalar_ok(advantage, require_advantage) and _fast_scalar_ok(reward, require_metrics_fields)):
            return None
        spans = values.get(LOSS_MASKING_SPANS)
        spans = [] if spans is None else _common_spans(spans, size // _TOKEN_DTYPE.itemsize)
        if spans is None:
            return None
    except (LookupError, TypeError, AttributeError, ValueError):  # orjson.JSONDecodeError is a ValueError
        return None  # not the common layout; _parse says why
    return Document(
        np.frombuffer(token_bytes, _TOKEN_DTYPE),
        np.frombuffer(logprob_bytes, _LOGPROB_DTYPE),
        None if version_bytes is None else np.frombuffer(version_bytes, _TOKEN_DTYPE),
        spans,
        advantage,
        reward,
    )


def _common_spans(value: Any, num_tokens: int) -> Optional[list[tuple[int, int]]]:
    """The spans if ``value`` is a list of in-range integer ``[begin, end]`` pairs, else None (see :func:`_spans`)."""
    if type(value) is not list:
        return None
    spans = []
    for span in value:
        if type(span) is not list or len(span) != 2:
            return None
        begin, end = span
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= num_tokens:
            return None
        spans.append((begin, end))
    return spans


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


_INT64_LIMIT = 2**63


def _check_documents(documents: list[tuple[int, Document]], results: list[Any], vocab_size: Optional[int]) -> None:
    """Run :func:`_check_values` over ``documents`` (index in ``results``, document): once over their
    concatenated arrays, and document by document only when that fails, replacing each bad document in
    ``results`` by its error. Viewed as uint64, a negative int64 is >= 2^63, so one maximum checks both bounds."""
    docs = [doc for _, doc in documents]
    token_limit = _INT64_LIMIT if vocab_size is None else vocab_size
    versions = [doc.model_version for doc in docs if doc.model_version is not None]
    if (
        int(np.concatenate([doc.tokens for doc in docs]).view(np.uint64).max()) < token_limit
        and np.isfinite(np.concatenate([doc.old_log_probabilities for doc in docs])).all()
        and (not versions or int(np.concatenate(versions).view(np.uint64).max()) < _INT64_LIMIT)
    ):
        return
    for index, doc in documents:
        try:
            _check_values(doc, vocab_size)
        except MalformedEntry as error:
            results[index] = error


def _check_values(doc: Document, vocab_size: Optional[int]) -> None:
    """The per-document form of :func:`_check_documents`, raising the first problem with its numbers."""
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
