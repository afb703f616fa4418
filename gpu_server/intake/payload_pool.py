"""Memory that records were joined in, reused for new records once nothing else holds it (docs/design.md §6.3).

A record of several chunks is joined in a private anonymous mapping (`assembler._Payload`). Fresh memory costs a
page fault and a zeroed page per 4 KiB on its first touch, about twice the copy of the chunk into it (on this
project's 2-core VM: 0.40 s of system CPU per GiB read into fresh mappings, 0.13 s into one already touched). So the
mappings are sized in classes of `GRAIN` bytes and remembered here (`keep`), and a new record takes one of its class
that nothing else holds any more (`take`): no view of it, no tensor over it, no job, no spool batch. That is known
from the mapping's reference count, since everything that reads a payload holds a reference to it (a memoryview,
or a buffer export that keeps its object): the pool is protos/reuse_pool.py's, as the agent's frames are. A reused
mapping's bytes past the record's own length are never part of it (its view is cut to the record's length).

The pool remembers at most `limit` bytes of mappings, free or still in use; beyond it, it forgets those still in
use first (they are freed as before once let go), then the oldest free ones. The server sets the limit to a quarter
of its memory budget (`--memory-mb`): memory it keeps past a record's check, so that the next ones of its size need
no new pages. Records of one call site have the same size from step to step, so in a training that the server
keeps up with, most mappings are reused; when every record is in memory at once (a backlog), nothing is free to
reuse and nothing changes."""
from __future__ import annotations

import mmap

from protos.reuse_pool import ReusePool

GRAIN = 1 << 20   # size classes: whole MiB (a class's untouched pages past a record take no memory)


def size_class(n: int) -> int:
    return max(GRAIN, -(-n // GRAIN) * GRAIN)


def _open(m: mmap.mmap) -> bool:
    return not m.closed


class PayloadPool(ReusePool[mmap.mmap]):
    """Mappings by size class, handed out again once the pool is their last holder, never once closed."""

    def __init__(self, limit: int = 0) -> None:
        super().__init__(limit, usable=_open)

    def take(self, n: int) -> mmap.mmap | None:
        """A free mapping of n's size class, or None."""
        return super().take(size_class(n))


PAYLOADS = PayloadPool()   # its limit: a quarter of the server's memory budget (FrameAssembler, from its budget)
