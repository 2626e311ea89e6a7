"""The pure parts of weight transfer and gradient sync: chunk plans, buckets, checks."""
import pytest
import torch

from gyre_hpc.cells.gradsync import buckets_of
from gyre_hpc.cells.weights import (TensorSpec, _receive_buffers, describe, dtype_from_name, plan_chunks,
                                    state_checksum)


def test_chunks_cover_every_byte_once_and_respect_the_limit():
    specs = [TensorSpec("a", "float32", (5,), 20), TensorSpec("e", "float32", (0,), 0),
             TensorSpec("b", "bfloat16", (7,), 14), TensorSpec("c", "int64", (30,), 240)]
    chunks = plan_chunks(specs, 16)
    assert all(sum(p.stop - p.start for p in ch) <= 16 for ch in chunks)
    covered = {i: [] for i in range(len(specs))}
    for ch in chunks:
        for p in ch:
            covered[p.index].append((p.start, p.stop))
    for i, spec in enumerate(specs):
        pos = 0
        for start, stop in covered[i]:
            assert start == pos
            pos = stop
        assert pos == spec.nbytes
    assert sum(sum(p.stop - p.start for p in ch) for ch in chunks) == 274
    assert len(chunks) == -(-274 // 16)
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        plan_chunks(specs, 0)


def test_a_2gb_state_dict_is_never_one_message():
    specs = [TensorSpec("huge", "bfloat16", (1536 << 20,), 3 << 30)]
    chunks = plan_chunks(specs, 32 << 20)
    assert len(chunks) == 96 and max(p.stop - p.start for ch in chunks for p in ch) == 32 << 20


def test_receiver_mismatch_names_the_tensor():
    specs = describe({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"tensor w: sender has float32\[2, 3\], receiver bfloat16\[2, 3\]"):
        _receive_buffers(specs, {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"missing locally \['b'\]"):
        _receive_buffers(specs, {"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="does not have"):
        dtype_from_name("float33")


def test_checksum_sees_one_flipped_bit_and_a_renamed_tensor():
    a = {"w": torch.arange(10, dtype=torch.float32)}
    b = {"w": a["w"].clone()}
    assert state_checksum(a) == state_checksum(b)
    b["w"].view(torch.int32)[3] ^= 1
    assert state_checksum(a) != state_checksum(b)
    assert state_checksum(a) != state_checksum({"v": a["w"]})


def test_buckets_group_by_reduce_dtype_and_size():
    ts = [torch.zeros(100), torch.zeros(100, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.float64),
          torch.zeros(300), torch.zeros(50)]
    buckets = buckets_of(ts, bucket_bytes=1000)
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3, 4]
    for b in buckets:
        kinds = {torch.float64 if ts[i].dtype == torch.float64 else torch.float32 for i in b}
        assert len(kinds) == 1
        assert len(b) == 1 or sum(ts[i].numel() * (8 if ts[i].dtype == torch.float64 else 4) for i in b) <= 1000
    # float32 and bf16 share a bucket (both reduce in float32); the 1200-byte tensor is a bucket
    # of its own, float64 never mixes with float32.
    assert sorted(buckets) == [[0, 1], [2], [3], [4]]
