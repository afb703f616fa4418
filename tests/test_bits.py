"""gpu_server/judging/bits.py: bitwise equality, against the bytes themselves, for every dtype the wire carries."""
from __future__ import annotations

import pytest
import torch

from gpu_server.judging import bits
from gpu_server.judging.bits import same_bits
from gpu_server.judging.output_kind import bit_identical

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype) if not dtype.is_complex else \
            torch.randn(n, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_the_bytes_wherever_one_element_differs(dtype):
    n = 3 * bits._SLICE + 17   # several slices and a short last one
    a = _tensor(dtype, n)
    assert same_bits(a, a.clone())
    for pos in (0, bits._SLICE - 1, bits._SLICE, n - 1):   # first, slice edges, last
        b = a.clone()
        b.view(torch.uint8)[pos * a.element_size()] ^= 1
        assert same_bits(a, b) is (_raw(a) == _raw(b)) is False, (dtype, pos)


def test_nan_payloads_and_signed_zeros_are_bits():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert not same_bits(a, torch.tensor([-0.0, float("nan"), 1.0]))     # torch.equal would say they differ too
    other_nan = a.clone()
    other_nan.view(torch.int32)[1] |= 1                                    # another NaN payload
    assert not same_bits(a, other_nan)
    assert same_bits(a, a.clone())                                         # NaN == NaN, bit for bit


def test_dtype_shape_and_layout():
    a = torch.arange(12.0).reshape(3, 4)
    assert not same_bits(a, a.double())
    assert not same_bits(a, a.reshape(4, 3))
    assert same_bits(a.t(), a.t().contiguous())                            # a non-contiguous view: its values
    assert not same_bits(a.t(), a.contiguous().reshape(4, 3))
    z = torch.randn(5, dtype=torch.complex64)
    assert same_bits(z.conj(), z.conj().resolve_conj())                    # a lazy conjugate: its values
    assert not same_bits(z.conj(), z)
    empty = torch.empty(0, 3).expand(0, 3)
    assert same_bits(empty, torch.zeros(0, 3)) and not same_bits(torch.zeros(0), torch.zeros(0, 3))
    leaf = torch.randn(4, requires_grad=True)
    assert same_bits(leaf, leaf.detach().clone())


def test_bit_identical_takes_the_device_and_keeps_its_none():
    a = torch.randn(7)
    assert bit_identical(a, a.clone()) and not bit_identical(None, a) and not bit_identical(a.half(), a)
