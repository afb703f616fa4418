"""gpu_server/memcopy.py: a copy that lets the interpreter lock go gives the bytes a slice assignment gives, from
every kind of buffer the server copies (bytes, bytearray, a mapping, views of them at any offset) into mappings and
views, small and large; a copy that does not fit, or into a read-only buffer, raises and writes nothing."""
from __future__ import annotations

import mmap
import random

import pytest

from gpu_server.memcopy import LARGE, copy_into


def _sources(n: int, seed: int) -> list:
    data = random.Random(seed).randbytes(n + 7)
    m = mmap.mmap(-1, n + 7)
    m[:] = data
    return [data[:n], bytearray(data[:n]), memoryview(data)[7:], memoryview(m)[3:3 + n]]


@pytest.mark.parametrize("n", [0, 1, LARGE - 1, LARGE, 3 * LARGE + 5])
@pytest.mark.parametrize("offset", [0, 1, 4093])
def test_the_bytes_are_those_of_a_slice_assignment(n, offset):
    for i, src in enumerate(_sources(n, n + offset)):
        size = offset + n + 11
        dst, want = mmap.mmap(-1, size), bytearray(random.Random(i).randbytes(size))
        dst[:] = bytes(want)
        assert copy_into(dst, offset, src) == n
        want[offset:offset + n] = bytes(src)
        assert dst[:] == bytes(want), (type(src), n, offset)
        view_dst = bytearray(size)
        copy_into(memoryview(view_dst)[2:], offset, src)   # into a view that starts inside its buffer
        assert view_dst[2 + offset:2 + offset + n] == bytes(src)


@pytest.mark.parametrize("n", [100, 2 * LARGE])
def test_a_copy_that_does_not_fit_or_into_read_only_memory_raises_and_writes_nothing(n):
    src = bytes(range(256)) * (n // 256 + 1)
    src = src[:n]
    dst = bytearray(n)
    with pytest.raises((IndexError, ValueError)):
        copy_into(dst, 1, src)
    assert dst == bytearray(n)
    with pytest.raises((TypeError, ValueError)):
        copy_into(bytes(n), 0, src)
