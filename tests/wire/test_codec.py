"""Wire codec (DESIGN §3): round trips, upstream byte compatibility, the PipelineRL JSON variant, rejections."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_wire import codec
from rljob_wire.documents import DocumentColumns
from rljob_wire.codec import (
    Document,
    DocumentTooLong,
    MalformedEntry,
    MalformedKind,
    decode_entries,
    decode_entry,
    encode_document,
)


def wire(message: dict[str, bytes]) -> dict[bytes, bytes]:
    """What XREADGROUP hands back for an XADD of ``message`` (bytes keys)."""
    return {key.encode(): value if isinstance(value, bytes) else str(value).encode() for key, value in message.items()}


def decode(message: dict, **kwargs) -> Document:
    kwargs.setdefault("require_metrics_fields", False)
    kwargs.setdefault("max_tokens", None)
    return decode_entry(wire(message), **kwargs)


def assert_same(a: Document, b: Document) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.dtype == np.int64 and b.tokens.dtype == np.int64
    np.testing.assert_array_equal(a.old_log_probabilities, b.old_log_probabilities)
    assert b.old_log_probabilities.dtype == np.float32
    if a.model_version is None:
        assert b.model_version is None
    else:
        np.testing.assert_array_equal(a.model_version, b.model_version)
    assert list(a.loss_masking_spans) == list(b.loss_masking_spans)
    assert a.advantage == b.advantage and a.reward == b.reward


@st.composite
def documents(draw) -> Document:
    length = draw(st.integers(1, 48))
    tokens = np.array(draw(st.lists(st.integers(0, 2**40), min_size=length, max_size=length)), dtype=np.int64)
    logprob = st.floats(-30.0, 0.0, width=32, allow_nan=False)
    old = np.array(draw(st.lists(logprob, min_size=length, max_size=length)), dtype=np.float32)
    version = draw(st.none() | st.lists(st.integers(0, 2**62), min_size=length, max_size=length))
    bounds = st.tuples(st.integers(0, length), st.integers(0, length)).map(sorted).map(tuple)
    spans = draw(st.lists(bounds, max_size=3))
    scalar = st.none() | st.floats(allow_nan=False, allow_infinity=False, width=32)
    return Document(
        tokens=tokens,
        old_log_probabilities=old,
        model_version=None if version is None else np.array(version, dtype=np.int64),
        loss_masking_spans=spans,
        advantage=draw(scalar),
        reward=draw(scalar),
    )


@settings(max_examples=150, deadline=None)
@given(documents())
def test_round_trip_of_random_documents(doc):
    back = decode(encode_document(doc), require_advantage=False)
    assert_same(doc, back)


@settings(max_examples=50, deadline=None)
@given(documents())
def test_json_list_variant_decodes_to_the_same_document(doc):
    """PipelineRL writers: per-token fields as JSON lists, either as field values or inside ``data``."""
    data = {"old_log_probabilities": doc.old_log_probabilities.tolist(), "loss_masking_spans": doc.loss_masking_spans}
    if doc.model_version is not None:
        data["model_version"] = doc.model_version.tolist()
    if doc.reward is not None:
        data["reward"] = doc.reward
    message = {"tokens": json.dumps(doc.tokens.tolist()).encode(), "data": json.dumps(data).encode()}
    if doc.advantage is not None:
        message["advantage"] = json.dumps(doc.advantage).encode()
    assert_same(doc, decode(message, require_advantage=False))


def test_bytes_match_fast_llm_layout_written_by_hand():
    doc = Document(
        tokens=np.array([1, 2, 258]),
        old_log_probabilities=np.array([0.0, -0.5, -1.25], dtype=np.float32),
        loss_masking_spans=[(0, 1)],
        advantage=0.25,
    )
    message = encode_document(doc)
    assert list(message) == ["tokens", "old_log_probabilities", "data"]
    assert message["tokens"] == (
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x02\x01\x00\x00\x00\x00\x00\x00"
    )
    # IEEE-754 little endian: 0.0, -0.5 = 0xBF000000, -1.25 = 0xBFA00000.
    assert message["old_log_probabilities"] == b"\x00\x00\x00\x00\x00\x00\x00\xbf\x00\x00\xa0\xbf"
    assert message["data"] == b'{"loss_masking_spans": [[0, 1]], "advantage": 0.25}'

    # Fast-LLM's RedisDocument.from_message: merge data's keys, torch.frombuffer int64 / float32.
    fields = dict(message)
    fields.update(json.loads(fields.pop("data")))
    assert torch.frombuffer(bytearray(fields["tokens"]), dtype=torch.int64).tolist() == [1, 2, 258]
    assert torch.frombuffer(bytearray(fields["old_log_probabilities"]), dtype=torch.float32).tolist() == [
        0.0,
        -0.5,
        -1.25,
    ]
    assert fields["loss_masking_spans"] == [[0, 1]] and fields["advantage"] == 0.25


def test_model_version_and_reward_encoding():
    doc = Document(
        np.array([5, 6]), np.zeros(2, np.float32), model_version=np.array([7, 2**40]), advantage=-1.0, reward=0.5
    )
    message = encode_document(doc)
    assert message["model_version"] == np.array([7, 2**40], dtype="<i8").tobytes()
    assert json.loads(message["data"]) == {"advantage": -1.0, "reward": 0.5}


@pytest.mark.parametrize(
    ("spans", "expected"),
    [
        ([], [0, 1, 1, 1, 1, 1]),
        ([(0, 3)], [0, 0, 0, 1, 1, 1]),  # prompt of 3 tokens: the first label is tokens[3]
        ([(2, 4)], [0, 1, 0, 0, 1, 1]),
        ([(0, 1), (5, 6)], [0, 1, 1, 1, 1, 0]),
        ([(3, 3)], [0, 1, 1, 1, 1, 1]),
    ],
)
def test_label_mask_follows_fast_llm(spans, expected):
    doc = Document(np.arange(6), np.zeros(6, np.float32), loss_masking_spans=spans)
    assert doc.label_mask().tolist() == [bool(x) for x in expected]


def test_raw_tokens_starting_with_bracket_byte_are_binary():
    tokens = np.array([91, 93, 44], dtype=np.int64)  # 0x5B '[' first byte
    doc = decode(
        {
            "tokens": tokens.tobytes(),
            "old_log_probabilities": np.zeros(3, np.float32).tobytes(),
            "data": b'{"advantage": 1}',
        }
    )
    assert doc.tokens.tolist() == [91, 93, 44] and doc.advantage == 1.0


def good(**overrides) -> dict:
    message = encode_document(
        Document(np.arange(4), np.full(4, -0.5, np.float32), np.arange(4), [(0, 2)], advantage=0.5, reward=1.0)
    )
    message.update(overrides)
    return {key: value for key, value in message.items() if value is not None}


MALFORMED = [
    ("no tokens", good(tokens=None), MalformedKind.MISSING_FIELD, "tokens"),
    ("no logprobs", good(old_log_probabilities=None), MalformedKind.MISSING_FIELD, "old_log_probabilities"),
    ("no advantage", good(data=b'{"reward": 1.0}'), MalformedKind.MISSING_FIELD, "advantage"),
    (
        "short logprobs",
        good(old_log_probabilities=np.zeros(3, np.float32).tobytes()),
        MalformedKind.LENGTH_MISMATCH,
        "3 values",
    ),
    ("long versions", good(model_version=np.arange(5).tobytes()), MalformedKind.LENGTH_MISMATCH, "model_version"),
    ("token bytes", good(tokens=b"\x01" * 12), MalformedKind.BAD_DTYPE_SIZE, "12 bytes"),
    ("logprob bytes", good(old_log_probabilities=b"\x00" * 15), MalformedKind.BAD_DTYPE_SIZE, "float32"),
    (
        "inverted span",
        good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[3, 1]]}'),
        MalformedKind.BAD_SPAN,
        "[3, 1)",
    ),
    (
        "span past end",
        good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[0, 5]]}'),
        MalformedKind.BAD_SPAN,
        "[0, 4]",
    ),
    (
        "negative span",
        good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[-1, 2]]}'),
        MalformedKind.BAD_SPAN,
        "inverted or outside",
    ),
    ("spans zero", good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": 0}'), MalformedKind.BAD_SPAN, "int"),
    (
        "bool span",
        good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[false, 2]]}'),
        MalformedKind.BAD_SPAN,
        "[begin, end]",
    ),
    ("huge advantage", good(data=b'{"advantage": 1e999, "reward": 1}'), MalformedKind.NON_FINITE, "advantage"),
    ("float64 reward", good(data=b'{"advantage": 1, "reward": -1e300}'), MalformedKind.NON_FINITE, "float32's range"),
    (
        "huge integer reward",
        good(data=b'{"advantage": 1, "reward": ' + b"9" * 400 + b"}"),
        MalformedKind.NON_FINITE,
        "reward",
    ),
    (
        "span shape",
        good(data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[1, 2, 3]]}'),
        MalformedKind.BAD_SPAN,
        "[begin, end]",
    ),
    ("nan advantage", good(data=b'{"advantage": NaN, "reward": 1}'), MalformedKind.NON_FINITE, "advantage"),
    ("inf reward", good(data=b'{"advantage": 1, "reward": -Infinity}'), MalformedKind.NON_FINITE, "reward"),
    (
        "nan logprob",
        good(old_log_probabilities=np.array([0, np.nan, 0, 0], np.float32).tobytes()),
        MalformedKind.NON_FINITE,
        "old_log_probabilities[1]",
    ),
    ("bad data json", good(data=b'{"advantage": 1,'), MalformedKind.BAD_JSON, "data"),
    ("data not object", good(data=b"[1, 2]"), MalformedKind.BAD_JSON, "object"),
    ("string advantage", good(data=b'{"advantage": "high", "reward": 1}'), MalformedKind.BAD_VALUE, "advantage"),
    ("float tokens", good(tokens=b"[1.5, 2, 3, 4]"), MalformedKind.BAD_VALUE, "integers"),
    ("negative token", good(tokens=np.array([0, -3, 1, 2]).tobytes()), MalformedKind.BAD_VALUE, "-3"),
    ("empty tokens", good(tokens=b""), MalformedKind.BAD_VALUE, "empty"),
    (
        "duplicate field",
        good(data=b'{"advantage": 1, "reward": 1, "tokens": [1, 2, 3, 4]}'),
        MalformedKind.BAD_VALUE,
        "both",
    ),
]


@pytest.mark.parametrize(("message", "kind", "needle"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_entries_name_kind_and_field(message, kind, needle):
    with pytest.raises(MalformedEntry) as caught:
        decode(message, require_metrics_fields=True)
    assert caught.value.kind == kind
    assert needle in caught.value.reason


@pytest.mark.parametrize(("drop", "needle"), [("model_version", "model_version"), ("data", "reward")])
def test_metrics_fields_are_required_only_when_metrics_are_on(drop, needle):
    message = good(**{drop: None})
    if drop == "data":
        message["data"] = b'{"advantage": 0.5}'
    doc = decode(message, require_metrics_fields=False)
    assert doc.reward is None or doc.model_version is None
    with pytest.raises(MalformedEntry) as caught:
        decode(message, require_metrics_fields=True)
    assert caught.value.kind == MalformedKind.MISSING_METRICS_FIELD and needle in caught.value.reason


def test_vocabulary_bound_and_length_budget():
    with pytest.raises(MalformedEntry, match="id 3 >= vocabulary size 3"):
        decode(good(), vocab_size=3)
    assert decode(good(), vocab_size=4).tokens.tolist() == [0, 1, 2, 3]
    with pytest.raises(DocumentTooLong) as caught:
        decode(good(), max_tokens=3)
    assert caught.value.kind == MalformedKind.TOO_LONG and caught.value.num_tokens == 4
    assert decode(good(), max_tokens=4).num_tokens == 4


def test_batch_decode_isolates_bad_values_to_their_entries():
    entries = [
        good(),
        good(tokens=np.array([0, 1, -2, 3]).tobytes()),
        good(old_log_probabilities=np.array([0, 0, 0, np.inf], np.float32).tobytes()),
        good(model_version=np.array([0, -1, 0, 0]).tobytes()),
        good(tokens=None),
        good(),
    ]
    results = decode_entries([wire(e) for e in entries], require_metrics_fields=True, max_tokens=None)
    assert isinstance(results[0], Document) and isinstance(results[5], Document)
    assert [r.kind for r in results[1:5]] == ["bad_value", "non_finite", "bad_value", "missing_field"]
    assert "negative id (-2)" in results[1].reason and "`old_log_probabilities[3]` = inf" in results[2].reason
    assert "`model_version` holds -1 < 0" in results[3].reason


def test_encode_rejects_length_mismatch():
    with pytest.raises(ValueError, match=r"old_log_probabilities: expected shape \[3\]"):
        encode_document(Document(np.arange(3), np.zeros(2, np.float32)))


def slow_path_variants() -> list[dict]:
    """Entries outside the writer's layout, valid or not: the fast path must leave each to the full parser."""
    return [
        {**good(), "chosen_span": b"[0, 1]"},  # unknown field (Fast-LLM's DPO fields)
        {**good(data=b'{"reward": 1.0}'), "advantage": b"0.25"},  # a data key sent as a top-level field
        good(tokens=b"[0, 1, 2, 3]"),  # PipelineRL's JSON-list tokens
        good(data=b'{"advantage": 0.5, "reward": 1.0, "loss_masking_spans": [[true, 2]]}'),  # bool: bad span
        good(data=b'{"advantage": true, "reward": 1.0}'),  # bool: bad advantage
    ]


def test_batch_decode_equals_decoding_each_entry_alone():
    """The fast path for the writer's layout and the chunked value checks change no outcome: every entry of a
    mixed batch (valid, valid in other layouts, every malformed kind) decodes as it does alone."""
    spaced = good(data=b' {"advantage": 0.5, "reward": 1.0} \n')
    entries = [wire(m) for m in [good(), spaced, *slow_path_variants(), *(m[1] for m in MALFORMED), good()]]
    results = decode_entries(entries, require_metrics_fields=True, max_tokens=None)
    assert len(results) == len(entries)
    for fields, result in zip(entries, results, strict=True):
        try:
            alone = decode_entry(fields, require_metrics_fields=True, max_tokens=None)
        except MalformedEntry as error:
            assert isinstance(result, MalformedEntry), fields
            assert (result.kind, result.reason) == (error.kind, error.reason)
        else:
            assert isinstance(result, Document), (fields, result)
            assert_same(alone, result)
    assert sum(isinstance(r, Document) for r in results) == 3 + 3


def test_writer_layout_takes_the_fast_path_and_other_layouts_the_parser():
    """Guards the hot path: what encode_document writes (including raw tokens whose first byte is ``[``, and JSON
    integers as scalars) never falls back to the full parser; every other layout does, also beside valid entries."""
    bracket = good(tokens=np.array([91, 1, 2, 3]).tobytes())
    integers = good(data=b'{"advantage": 1, "reward": 2, "loss_masking_spans": [[0, 2]]}')
    fast = [good(), bracket, good(model_version=None, data=b'{"advantage": 0.5}'), integers]
    entries = [wire(m) for m in fast + slow_path_variants() + fast * 3]
    parts, rest, errors = codec._decode_common_layout(entries, codec._CommonChecks(math.inf, False, True, None))
    slow = list(range(4, 4 + len(slow_path_variants())))
    fast_rows = sorted(row for rows, _ in parts for row in rows.tolist())
    assert fast_rows == [i for i in range(len(entries)) if i not in slow]
    assert sorted(rest) == slow and not errors
    columns = DocumentColumns.concatenate([columns for _, columns in parts])
    assert columns.document(1).tokens.tolist() == [91, 1, 2, 3] and columns.document(2).model_version is None
    assert (columns.document(3).advantage, columns.document(3).reward) == (1.0, 2.0)
    assert type(columns.document(3).advantage) is float


def test_bytearray_and_memoryview_values_decode_as_bytes_do():
    """redis-py returns bytes; a caller holding bytearrays (or a memoryview of ``data``) gets the same documents."""
    message = wire(good())
    expected = decode_entry(message, require_metrics_fields=True, max_tokens=None)
    variants = [{**message, b"tokens": bytearray(message[b"tokens"])},
                {**message, b"model_version": bytearray(message[b"model_version"])},
                {**message, b"data": bytearray(message[b"data"])},
                {**message, b"data": memoryview(message[b"data"])}]
    results = decode_entries(variants, require_metrics_fields=True, max_tokens=None)
    for result in results:
        assert_same(expected, result)


def test_a_vocabulary_beyond_int64_still_refuses_negative_ids():
    entries = [wire(good(tokens=np.array([0, -1, 2, 3]).tobytes())), wire(good())]
    bad, fine = decode_entries(entries, require_metrics_fields=True, max_tokens=None, vocab_size=2**64)
    assert bad.kind == "bad_value" and "negative id (-1)" in bad.reason and isinstance(fine, Document)


def test_raw_bytes_that_start_and_end_like_a_json_list_are_still_binary():
    tokens = np.array([91, 0x5D << 56], dtype=np.int64)  # first byte '[', last byte ']'
    message = good(tokens=tokens.tobytes(), old_log_probabilities=np.zeros(2, np.float32).tobytes(), model_version=None)
    message["data"] = b'{"advantage": 1.0}'
    assert decode(message).tokens.tolist() == [91, 0x5D << 56]


def test_value_checks_over_a_batch_flag_only_the_bad_entries():
    """The per-token values are checked over the whole batch at once: bad values in the first and in a later entry are
    found, and only those entries are rejected."""
    length = 512
    count = 131
    docs = [Document(np.arange(length), np.full(length, -0.5, np.float32), advantage=0.5) for _ in range(count)]
    messages = [encode_document(doc) for doc in docs]
    messages[3]["old_log_probabilities"] = np.where(np.arange(length) == 7, np.nan, -0.5).astype("<f4").tobytes()
    messages[count - 2]["tokens"] = np.where(np.arange(length) == 9, -4, np.arange(length)).tobytes()
    results = decode_entries([wire(m) for m in messages], require_metrics_fields=False, max_tokens=None)
    bad = {i: r for i, r in enumerate(results) if not isinstance(r, Document)}
    assert sorted(bad) == [3, count - 2]
    assert bad[3].kind == "non_finite" and "old_log_probabilities[7]" in bad[3].reason
    assert bad[count - 2].kind == "bad_value" and "negative id (-4)" in bad[count - 2].reason
    assert results[count - 1].tokens.tolist() == list(range(length))


def test_json_nested_too_deeply_is_bad_json_not_a_crash():
    deep = b'{"advantage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(MalformedEntry) as caught:
        decode(good(data=deep))
    assert caught.value.kind == MalformedKind.BAD_JSON and "nested too deeply" in caught.value.reason
