"""Transparent huge pages for fresh memory about to be written whole: off unless `ONLINE_CHECK_HUGE_PAGES=1`.

Both ends of the wire take fresh memory for large records: the agent's new frames over 2 MiB
(npu_agent/payload.py), the server's buffer that joins a record's chunks (gpu_server/intake/assembler.py
`_Payload`). With huge pages asked for (`madvise(MADV_HUGEPAGE)`) its first touch costs one fault per 2 MiB instead
of one per 4 KiB page. Whether that is cheaper depends on the host: on a virtual machine that hands freed memory
back to its host (free page reporting), each huge page is memory the host must provide anew, and that costs far more
than the 4 KiB faults it saves. docs/design.md §6.3 has the measurements; like PyTorch's own opt-in
(`THP_MEM_ALLOC_ENABLE`), they are asked for only when this variable says so. The bytes are the same either way.
"""
from __future__ import annotations

import os

ENV = "ONLINE_CHECK_HUGE_PAGES"
HUGE_PAGE = 2 << 20   # a transparent huge page (x86-64; arm64 with 4 KiB pages)


def wanted() -> bool:
    """Whether fresh memory for large records asks for huge pages (read at each use: a few per large record)."""
    return os.environ.get(ENV, "") == "1"


def whole_huge_pages(base: int, start: int, end: int) -> tuple[int, int]:
    """The offsets [lo, hi) of the whole huge pages inside [start, end) of a buffer at address `base` (lo >= hi:
    none)."""
    lo = -(-(base + start) // HUGE_PAGE) * HUGE_PAGE - base
    hi = (base + end) // HUGE_PAGE * HUGE_PAGE - base
    return lo, hi
