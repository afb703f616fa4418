"""The extremes (smallest and largest element, NaN if any) of a float tensor, read once per checked call.

Two readers want them for the same outputs: the finiteness of a call's outputs (gpu_server/judging/nonfinite.py: an
inf or NaN element makes an extreme non-finite) and the first pass of the metrics (gpu_server/judging/metrics.py: the
largest |value| of each side, for the cosine's normalisation). Each is one pass over the output's memory. Within a
`remembered()` block (gpu_server/checking/checker.py opens one around each checked call, on its one thread) the
second reader of the same memory gets the first one's answer: the same tensors, computed by the same
`torch.aminmax` over the same elements.

The memory is recognised by what a view of it reads: device, dtype, address and element count of a contiguous
tensor (`reshape(-1)` and `detach()` make new tensor objects over the same elements), and the version counter that
an in-place write raises. The block holds the tensors it has seen, so no address is reused while it lasts.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_local = threading.local()


@contextlib.contextmanager
def memo_block(local: threading.local) -> Iterator[None]:
    """A fresh dict as `local.memo` within the block (on this thread), the one before it (or None) after it."""
    saved = getattr(local, "memo", None)
    local.memo = {}
    try:
        yield
    finally:
        local.memo = saved


def remembered() -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread), `aminmax` of memory it has read before returns the earlier answer."""
    return memo_block(_local)


def aminmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.aminmax(t)` (NaN propagates), remembered within a `remembered()` block for a contiguous tensor."""
    memo = getattr(_local, "memo", None)
    if memo is None or not t.is_contiguous():
        return torch.aminmax(t)
    key = (t.device, t.dtype, t.data_ptr(), t.numel())
    seen = memo.get(key)
    if seen is not None and seen[1] == t._version:
        return seen[2]
    ends = torch.aminmax(t)
    memo[key] = (t, t._version, ends)
    return ends
