"""Bitwise equality of two tensors: same dtype, same shape, same bits (NaN payloads and signed zeros included).

The metrics ask it of every pair of outputs they might compute twice (a device output bit-identical to the same-dtype
run, the usual case when the training ran on the bench's device type: gpu_server/judging/metrics.py `prefetch`), and
the standards ask it before they accuse a device (gpu_server/judging/output_kind.py `bit_identical`). On a CPU the
bytes are compared as integers of the element's width by numpy, in slices that stay in the cache, stopping at the
first slice that differs: 2-3.5x the bytes per second of `torch.equal` on this project's 2-core test machine (4M
float32 elements: 11.5 against 3.2 GB/s). Other devices use `torch.equal` on the same integer views.
"""
from __future__ import annotations

import threading

import numpy
import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SLICE = 1 << 16   # elements compared at a time: the comparison's booleans stay in the cache
_local = threading.local()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` have the same dtype, shape and bits (both on the same device)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or a.device != b.device:
        return False
    if b.numel() == 0:
        return True   # nothing to differ (an empty view may have stride 0, which an integer view refuses)
    a, b = (t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous() for t in (a, b))
    ints = _INTS.get(a.element_size())
    if ints is None:   # an element size no integer has: its bytes
        a, b, ints = a.view(torch.uint8), b.view(torch.uint8), torch.uint8
    a, b = a.view(ints), b.view(ints)
    if a.device.type != "cpu":
        return torch.equal(a, b)
    x, y = a.numpy(), b.numpy()
    n = x.shape[0]
    equal = getattr(_local, "equal", None)
    if equal is None:
        equal = _local.equal = numpy.empty(_SLICE, dtype=bool)   # this thread's, reused: no allocation per call
    for start in range(0, n, _SLICE):
        m = min(_SLICE, n - start)
        if not numpy.equal(x[start:start + m], y[start:start + m], out=equal[:m]).all():
            return False
    return True
