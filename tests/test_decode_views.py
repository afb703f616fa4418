"""The decoder's tensors (protos/codec.py RecordDecoder): for every dtype of the wire, each tensor is the payload's
bytes at its offset, of its dtype, shape and stride, a view of the payload where it is dense (no copy), at any
offset, also one that is not a multiple of the element size (a hostile or foreign client may send one); alone in its
record and beside two others (the decoder then reads the payload once a dtype and takes views of it). A tensor meta is
checked once (`_SeenMetas`), its place in the payload against every record's own size."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from protos import online_check_pb2 as pb
from protos.codec import _DTYPES, RecordDecoder, WireError, _seen_metas, _SeenMetas
from protos.limits import DEFAULT_LIMITS

SHAPES = [((), ()), ((0,), ()), ((7,), ()), ((2, 3), ()), ((3, 2), (1, 3)), ((2, 1, 4), ())]


def _payload(nbytes: int, dtype: torch.dtype) -> bytes:
    if dtype == torch.bool:   # a bool is one byte, 0 or 1 (a copy, for strides, writes 1 for any other byte)
        return bytes(i % 3 % 2 for i in range(nbytes))
    return bytes((i * 37 + 11) % 256 for i in range(nbytes))


def _address(payload: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value or 0


@pytest.mark.parametrize("name", sorted(_DTYPES))
@pytest.mark.parametrize("offset", [0, 3, 64])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-others"])
def test_each_tensor_is_its_bytes_at_its_offset(name, offset, beside):
    dtype = _DTYPES[name]
    for shape, stride in SHAPES:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        payload = _payload(offset + nbytes + 5, dtype)
        metas = [pb.TensorMeta(dtype=name, shape=shape, stride=stride, nbytes=nbytes, offset=offset)]
        if beside:   # two more tensors, of another dtype, over the same bytes
            metas += [pb.TensorMeta(dtype="int8", shape=[len(payload)], nbytes=len(payload), offset=0)] * 2
        rec = pb.Record(tensors=metas, payload_bytes=len(payload))
        t = RecordDecoder(rec, payload, DEFAULT_LIMITS).tensor(0)
        assert (t.dtype, tuple(t.shape)) == (dtype, shape), (name, shape)
        want = payload[offset:offset + nbytes]
        if stride and numel:
            assert t.stride() == stride, (name, shape)
            # the payload holds the elements in row-major order; the decoder lays them out with the strides sent
            got = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            assert t.is_contiguous(), (name, shape)
            got = t.reshape(-1).view(torch.uint8).numpy().tobytes() if numel else b""
            if numel:
                assert t.data_ptr() == _address(payload) + offset, f"{name} {shape}: not a view of the payload"
        assert got == want, (name, shape, offset)


def test_a_tensor_past_the_payload_is_still_refused_at_any_offset():
    rec = pb.Record(tensors=[pb.TensorMeta(dtype="float32", shape=[4], nbytes=16, offset=3)], payload_bytes=18)
    with pytest.raises(WireError, match="outside"):
        RecordDecoder(rec, bytes(18), DEFAULT_LIMITS)


def _one_tensor(payload_bytes: int) -> pb.Record:
    return pb.Record(tensors=[pb.TensorMeta(dtype="float32", shape=[4], nbytes=16, offset=64)],
                     payload_bytes=payload_bytes)


def test_a_meta_seen_before_is_checked_against_each_payload():
    RecordDecoder(_one_tensor(80), bytes(80), DEFAULT_LIMITS).tensor(0)   # valid: the meta is now known
    with pytest.raises(WireError, match=r"tensor 0: bytes 64\.\.80 lie outside the 70-byte payload"):
        RecordDecoder(_one_tensor(70), bytes(70), DEFAULT_LIMITS)


def test_a_meta_is_checked_under_the_limits_it_is_decoded_with():
    rec = pb.Record(tensors=[pb.TensorMeta(dtype="float32", shape=[2, 2, 2], nbytes=32)], payload_bytes=32)
    RecordDecoder(rec, bytes(32), DEFAULT_LIMITS)
    with pytest.raises(WireError, match="3 dimensions exceed the limit of 2"):
        RecordDecoder(rec, bytes(32), dataclasses.replace(DEFAULT_LIMITS, max_dims=2))


def test_the_metas_kept_are_bounded():
    limits = dataclasses.replace(DEFAULT_LIMITS)
    seen = _seen_metas(limits)
    for n in range(_SeenMetas.MAX + 10):
        rec = pb.Record(tensors=[pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)], payload_bytes=n)
        RecordDecoder(rec, bytes(n), limits)
        assert 0 < len(seen) <= _SeenMetas.MAX
    long = pb.Record(tensors=[pb.TensorMeta(dtype="uint8", shape=[1], nbytes=1, device="x" * 300)], payload_bytes=1)
    before = len(seen)
    RecordDecoder(long, bytes(1), limits)
    assert len(seen) == before   # a meta longer than MAX_KEY bytes is checked each time, never kept
