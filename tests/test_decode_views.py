"""The decoder's tensors (protos/codec.py RecordDecoder): for every dtype of the wire, each tensor is the payload's
bytes at its offset, of its dtype, shape and stride, a view of the payload where it is dense (no copy), at any
offset, also one that is not a multiple of the element size (a hostile or foreign client may send one)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from protos import online_check_pb2 as pb
from protos.codec import _DTYPES, RecordDecoder, WireError
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
def test_each_tensor_is_its_bytes_at_its_offset(name, offset):
    dtype = _DTYPES[name]
    for shape, stride in SHAPES:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        payload = _payload(offset + nbytes + 5, dtype)
        rec = pb.Record(tensors=[pb.TensorMeta(dtype=name, shape=shape, stride=stride, nbytes=nbytes, offset=offset)],
                        payload_bytes=len(payload))
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
