"""Memory that records were joined in, reused for new records once nothing else holds it (docs/design.md §6.3).

A record of several chunks is joined in a private anonymous mapping (`assembler._Payload`). Fresh memory costs a
page fault and a zeroed page per 4 KiB on its first touch, about twice the copy of the chunk into it (on this
project's 2-core VM: 0.40 s of system CPU per GiB read into fresh mappings, 0.13 s into one already touched). So the
mappings are sized in classes of `GRAIN` bytes and remembered here (`keep`), and a new record takes one of its class
that nothing else holds any more (`take`): no view of it, no tensor over it, no job, no spool batch. That is known
from the mapping's reference count, since everything that reads a payload holds a reference to it (a memoryview,
or a buffer export that keeps its object). A reused mapping's bytes past the record's own length are never part
of it (its view is cut to the record's length).

The pool remembers at most `limit` bytes of mappings, free or still in use; beyond it, it forgets those still in
use first (they are freed as before once let go), then the oldest free ones. The server sets the limit to a quarter
of its memory budget (`--memory-mb`): memory it keeps past a record's check, so that the next ones of its size need
no new pages. Records of one call site have the same size from step to step, so in a training that the server
keeps up with, most mappings are reused; when every record is in memory at once (a backlog), nothing is free to
reuse and nothing changes."""
from __future__ import annotations

import collections
import mmap
import sys
import threading

GRAIN = 1 << 20   # size classes: whole MiB (a class's untouched pages past a record take no memory)
_REFS_IN_POOL = 3   # sys.getrefcount of a mapping only the pool holds (the pool, a local name, the argument)


def size_class(n: int) -> int:
    return max(GRAIN, -(-n // GRAIN) * GRAIN)


class PayloadPool:
    """Mappings by size class, handed out again once the pool is their last holder."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._by_class: dict[int, dict[int, mmap.mmap]] = {}
        self._order: collections.OrderedDict[int, int] = collections.OrderedDict()   # id -> class, oldest first
        self.held = 0       # bytes of the mappings remembered (free or in use)
        self.reused = 0

    def take(self, n: int) -> mmap.mmap | None:
        """A mapping of n's class that nobody but the pool holds (forgotten by the pool: `keep` it again), or None."""
        c = size_class(n)
        with self._lock:
            maps = self._by_class.get(c)
            if not maps:
                return None
            for mid in maps:   # oldest first: the likeliest to be free
                m = maps[mid]
                if sys.getrefcount(m) == _REFS_IN_POOL and not m.closed:
                    break
            else:
                return None
            self._forget(mid, c)
            self.reused += 1
        return m

    def keep(self, m: mmap.mmap) -> None:
        """Remember a mapping handed out for a record, to reuse once it is let go (when it fits under the limit)."""
        c = len(m)
        if not self.limit or c > self.limit:
            return
        with self._lock:
            if self.held + c > self.limit:
                self._make_room(c)
            self._by_class.setdefault(c, {})[id(m)] = m
            self._order[id(m)] = c
            self.held += c

    def _make_room(self, need: int) -> None:
        """Forget mappings until `need` more bytes fit: those still in use first, then the oldest free ones."""
        for only_in_use in (True, False):
            for mid, c in list(self._order.items()):
                if self.held + need <= self.limit:
                    return
                if only_in_use and sys.getrefcount(self._by_class[c][mid]) == _REFS_IN_POOL - 1:
                    continue   # free (held by the dict and the argument only): kept for the second pass
                self._forget(mid, c)

    def _forget(self, mid: int, c: int) -> None:
        del self._by_class[c][mid]
        del self._order[mid]
        self.held -= c

    def clear(self) -> None:
        with self._lock:
            self._by_class.clear()
            self._order.clear()
            self.held = 0


PAYLOADS = PayloadPool()   # its limit: a quarter of the server's memory budget (FrameAssembler, from its budget)
