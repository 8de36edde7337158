"""Documents as columns (rljob_wire.documents): a batch decoded together equals its documents decoded one by one, and
the column operations the reader and the packer use keep every document intact."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_wire.codec import decode_columns, decode_entry, encode_document
from rljob_wire.documents import Document, DocumentColumns, label_masks
from test_codec import assert_same, documents, wire


def reference_label_mask(doc: Document) -> np.ndarray:
    """Fast-LLM's rule written out position by position: no label at t = 0, none inside a span."""
    mask = np.ones(len(doc.tokens), dtype=bool)
    if len(mask):
        mask[0] = False
    for begin, end in doc.loss_masking_spans:
        mask[begin:end] = False
    return mask


batches = st.lists(documents(), max_size=12)


@settings(max_examples=100, deadline=None)
@given(batches)
def test_a_batch_decoded_as_columns_equals_each_entry_decoded_alone(docs):
    entries = [wire(encode_document(doc)) for doc in docs]
    columns, rows, errors = decode_columns(entries, require_metrics_fields=False, max_tokens=None,
                                           require_advantage=False)
    assert not errors and rows.tolist() == list(range(len(docs)))
    assert columns.lengths.tolist() == [len(doc.tokens) for doc in docs]
    for doc, entry, decoded in zip(docs, entries, columns.documents(), strict=True):
        assert_same(doc, decoded)
        assert_same(decode_entry(entry, require_metrics_fields=False, max_tokens=None, require_advantage=False),
                    decoded)
    expected = np.concatenate([reference_label_mask(doc) for doc in docs] or [np.zeros(0, bool)])
    assert columns.label_mask.tolist() == expected.tolist() == label_masks(docs).tolist()


@settings(max_examples=100, deadline=None)
@given(batches, st.data())
def test_take_split_and_concatenate_keep_each_document(docs, data):
    columns = DocumentColumns.from_documents(docs)
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=len(docs), max_size=len(docs))), dtype=bool)
    kept = columns.take(keep)
    assert len(kept) == int(keep.sum())
    for doc, got in zip([d for d, k in zip(docs, keep) if k], kept.documents(), strict=True):
        assert_same(doc, got)
    assert kept.label_mask.tolist() == label_masks([d for d, k in zip(docs, keep) if k]).tolist()
    count = data.draw(st.integers(0, len(docs)))
    head, tail = columns.head(count), columns.tail(count)
    assert (len(head), len(tail)) == (count, len(docs) - count)
    for doc, got in zip(docs, DocumentColumns.concatenate([head, tail]).documents(), strict=True):
        assert_same(doc, got)
    order = np.array(data.draw(st.permutations(range(len(docs)))), dtype=np.int64)
    for index, got in zip(order.tolist(), columns.take(order).documents(), strict=True):
        assert_same(docs[index], got)


@settings(max_examples=100, deadline=None)
@given(batches, st.integers(0, 2**62))
def test_staleness_is_the_oldest_version_of_the_labelled_tokens(docs, documents_seen):
    staleness, known = DocumentColumns.from_documents(docs).staleness(documents_seen)
    for index, doc in enumerate(docs):
        labelled = reference_label_mask(doc)
        if doc.model_version is None or not labelled.any():
            assert not known[index] and staleness[index] == 0
        else:
            assert known[index] and staleness[index] == documents_seen - int(doc.model_version[labelled].min())


def test_a_document_without_model_version_or_advantage_comes_back_without():
    docs = [Document(np.arange(3), np.zeros(3, np.float32)),
            Document(np.arange(2), np.zeros(2, np.float32), np.array([4, 5]), [(0, 1)], advantage=0.5, reward=1.0)]
    columns = DocumentColumns.from_documents(docs)
    first, second = columns.documents()
    assert (first.model_version, first.advantage, first.reward, first.loss_masking_spans) == (None, None, None, [])
    assert second.model_version.tolist() == [4, 5] and second.loss_masking_spans == [(0, 1)]
    assert (second.advantage, second.reward) == (0.5, 1.0)
    assert columns.offsets.tolist() == [0, 3, 5] and columns.label_mask.tolist() == [False, True, True, False, True]


def test_presence_of_model_version_is_kept_per_document_even_without_tokens():
    """An empty document without model_version beside one with it: the micro-batch carries no model_version (not
    every document has one), and the staleness of a version at the int64 maximum is still known."""
    from rljob_trainer.stream.batch import pack_columns

    top = 2**63 - 1
    docs = [Document(np.arange(3), np.zeros(3, np.float32), np.full(3, top), [], advantage=1.0),
            Document(np.zeros(0, np.int64), np.zeros(0, np.float32), None, [], advantage=1.0)]
    for order in (docs, docs[::-1]):
        columns = DocumentColumns.from_documents(order)
        assert [mb.model_version for mb in pack_columns(columns, 10)] == [None]
        assert [d.model_version is None for d in columns.documents()] == [d.model_version is None for d in order]
    staleness, known = DocumentColumns.from_documents(docs).staleness(10)
    assert known.tolist() == [True, False] and int(staleness[0]) == 10 - top


def test_take_refuses_rows_outside_the_documents():
    columns = DocumentColumns.from_documents([Document(np.arange(2), np.zeros(2, np.float32))] * 2)
    for rows in ([-1], [2]):
        try:
            columns.take(np.array(rows))
        except IndexError as error:
            assert "outside [0, 2)" in str(error)
        else:
            raise AssertionError(f"take({rows}) returned")
