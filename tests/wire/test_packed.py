"""The packed weight-transfer layout's plan and manifest (rljob_wire.packed), without a network."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_wire.packed import ALIGN, OWN_BUCKET_SHARE, BucketBuffers, Manifest, plan, view
from rljob_wire.transfer import _AllowListUnpickler

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def test_tensors_share_buckets_at_aligned_offsets_and_a_large_one_goes_alone():
    manifest = plan([("a", (3,), torch.float32), ("b", (10,), torch.bfloat16), ("big", (100,), torch.float32),
                     ("c", (0,), torch.float32), ("d", (2, 2), torch.int64)], bucket_bytes=128, own_bytes=129)
    rows = [(e.name, e.bucket, e.offset, e.nbytes) for e in manifest.entries]
    assert rows == [("a", 0, 0, 12), ("b", 0, 64, 20), ("big", 1, 0, 400), ("c", 2, 0, 0), ("d", 2, 0, 32)]
    assert manifest.bucket_sizes == (84, 400, 32)
    assert [manifest.alone(b) and manifest.alone(b).name for b in range(3)] == [None, "big", None]
    assert manifest.nbytes == 12 + 20 + 400 + 32
    assert [manifest.sole(b) and manifest.sole(b).name for b in range(3)] == [None, "big", None]


def test_a_tensor_of_at_least_own_bytes_fills_a_bucket_of_its_own():
    tensors = [("a", (3,), torch.float32), ("b", (2,), torch.float32), ("mid", (8,), torch.float32),
               ("c", (2,), torch.float32), ("big", (100,), torch.float32), ("d", (1,), torch.int64)]
    manifest = plan(tensors, bucket_bytes=128, own_bytes=32)
    assert [(e.name, e.bucket, e.offset) for e in manifest.entries] == [
        ("a", 0, 0), ("b", 0, 64), ("mid", 1, 0), ("c", 2, 0), ("big", 3, 0), ("d", 4, 0)]
    assert manifest.bucket_sizes == (72, 32, 8, 400, 8)
    assert [manifest.alone(b) and manifest.alone(b).name for b in range(5)] == [None, None, None, "big", None]
    # sole: a bucket holding one tensor's bytes and nothing else, which rank 0 may send from the tensor's memory
    assert [manifest.sole(b) and manifest.sole(b).name for b in range(5)] == [None, "mid", "c", "big", "d"]
    assert plan(tensors, 32 * 32) == plan(tensors, 32 * 32, own_bytes=32)  # the default: bucket_bytes // OWN_BUCKET_SHARE
    assert plan(tensors, 8 * 32).bucket_sizes[:2] == (12, 8)  # at 8 bytes, "a" and "b" fill their own


def test_a_tensor_that_does_not_fit_the_rest_of_a_bucket_opens_the_next():
    manifest = plan([("a", (20,), torch.float32), ("b", (40,), torch.float32), ("c", (4,), torch.float32)], 256, 257)
    assert [(e.bucket, e.offset) for e in manifest.entries] == [(0, 0), (1, 0), (1, 192)]  # b at 128 would end at 288
    assert manifest.bucket_sizes == (80, 208)


def test_the_manifest_crosses_the_wire_through_the_receivers_allow_list():
    manifest = plan([("model.w", torch.Size([4, 8]), torch.bfloat16), ("model.b", (8,), torch.float32)], 1 << 20)
    wire = _AllowListUnpickler(io.BytesIO(pickle.dumps(manifest.to_wire()))).load()
    assert Manifest.from_wire(wire) == manifest


@pytest.mark.parametrize("bad, match", [
    (("per-tensor", 64, (8,), ()), "layout 'per-tensor'"),
    (("packed", 64, (8,), (("x", (4,), torch.float32, 0, 0),)), "does not fit"),  # 16 bytes in an 8-byte bucket
    (("packed", 64, (64,), (("x", (1,), torch.float32, 0, 8),)), "does not fit"),  # unaligned offset
    (("packed", 64, (64,), (("x", (1,), torch.float32, 1, 0),)), "does not fit"),  # no such bucket
    (("packed", 64, (64,), (("x", (1,), "float32", 0, 0),)), "does not fit"),  # not a dtype
    (("packed", 64), "malformed manifest"),
])
def test_a_malformed_manifest_is_refused_naming_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        Manifest.from_wire(bad)


def test_plan_refuses_a_tiny_bucket_and_a_name_twice():
    with pytest.raises(ValueError, match="at least 64"):
        plan([("a", (1,), torch.float32)], 32)
    with pytest.raises(ValueError, match="own_bytes must be at least 1"):
        plan([("a", (1,), torch.float32)], 1024, own_bytes=0)
    with pytest.raises(ValueError, match="'a' twice"):
        plan([("a", (1,), torch.float32), ("a", (2,), torch.float32)], 1024)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.sampled_from(DTYPES)),
                max_size=30),
       st.integers(ALIGN, 4096), st.one_of(st.none(), st.integers(1, 5000)))
def test_every_tensor_round_trips_through_its_bucket_without_overlapping_another(specs, bucket_bytes, own_bytes):
    tensors = [(f"t{i}", tuple(shape), dtype) for i, (shape, dtype) in enumerate(specs)]
    manifest = plan(tensors, bucket_bytes, own_bytes)
    own = own_bytes if own_bytes is not None else max(bucket_bytes // OWN_BUCKET_SHARE, 1)
    assert all(manifest.sole(e.bucket) == e for e in manifest.entries if e.nbytes >= own or e.nbytes > bucket_bytes)
    assert [(e.name, e.shape, e.dtype) for e in manifest.entries] == tensors  # the order sent
    assert [e.bucket for e in manifest.entries] == sorted(e.bucket for e in manifest.entries)
    generator = torch.Generator().manual_seed(len(tensors))
    values = {name: (torch.randint(0, 2, shape, generator=generator).bool() if dtype == torch.bool
                     else torch.randint(0, 100, shape, generator=generator).to(dtype)) for name, shape, dtype in tensors}
    buckets = BucketBuffers()
    for bucket, size in enumerate(manifest.bucket_sizes):
        entries = manifest.in_bucket(bucket)
        alone = manifest.alone(bucket)
        assert size <= bucket_bytes or (alone is not None and size == alone.nbytes > bucket_bytes)
        spans = sorted((e.offset, e.offset + e.nbytes) for e in entries)
        assert all(start % ALIGN == 0 for start, _ in spans) and spans[-1][1] == size
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        memory = buckets.get(bucket, size, torch.device("cpu"))
        for entry in entries:
            view(memory, entry).copy_(values[entry.name])
        for entry in entries:
            assert torch.equal(view(memory, entry), values[entry.name]), entry
    assert buckets.nbytes <= 2 * max(manifest.bucket_sizes, default=0)


def test_bucket_buffers_are_kept_between_updates_and_grown_when_needed():
    buckets = BucketBuffers()
    first = [buckets.get(b, 100, torch.device("cpu")).data_ptr() for b in range(4)]
    assert first[0] == first[2] and first[1] == first[3] and first[0] != first[1]
    assert [buckets.get(b, 60, torch.device("cpu")).data_ptr() for b in range(2)] == first[:2]  # smaller: same memory
    assert buckets.get(0, 200, torch.device("cpu")).numel() == 200 and buckets.nbytes == 300


def test_whole_bucket_buffers_keep_one_slot_per_bucket_across_updates():
    buckets = BucketBuffers(whole=True)
    first = [buckets.get(b, 100, torch.device("cpu")).data_ptr() for b in range(4)]
    assert len(set(first)) == 4 and buckets.nbytes == 400  # every bucket of the update lasts until the next one
    assert [buckets.get(b, 100, torch.device("cpu")).data_ptr() for b in range(4)] == first  # the next update: same
    assert buckets.get(5, 10, torch.device("cpu")).numel() == 10 and buckets.nbytes == 410  # more buckets: grown
