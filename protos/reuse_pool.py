"""Buffers kept for reuse once nothing else holds them (docs/design.md §6.3): the agent's frames of acknowledged
records (npu_agent/payload.py `FRAMES`) and the server's mappings records are joined in
(gpu_server/intake/payload_pool.py `PAYLOADS`).

New memory costs a page fault and a zeroed page per 4 KiB on its first touch, about as much again as the copy into
it. Both sides make buffers of the same few sizes over and over (a call site's records have the same size from step
to step), so each keeps the ones it made, by size, and hands one out again once the pool is its only holder: its
reference count says so, since whatever still reads a buffer (gRPC's last message, a memoryview, a tensor, a job)
holds a reference to it.

The pool remembers at most `limit` bytes of buffers, free or still in use. Beyond it, it forgets those still in use
first (they are freed as before once let go), then the oldest free ones."""
from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Sized
from typing import Generic, TypeVar

T = TypeVar("T", bound=Sized)
_REFS_IN_POOL = 3   # sys.getrefcount of a buffer only the pool holds (its dict, a local name, the argument)


class ReusePool(Generic[T]):
    """Buffers by length (or capacity), each handed out again once the pool is its last holder. `usable`: a further
    test a free buffer must pass (a mapping not closed)."""

    def __init__(self, limit: int = 0, usable: Callable[[T], bool] | None = None) -> None:
        self.limit = limit
        self._usable = usable
        self._lock = threading.Lock()
        self._by_len: dict[int, dict[int, T]] = {}   # length -> {id: buffer}
        self._order: collections.OrderedDict[int, int] = collections.OrderedDict()   # id -> length, oldest first
        self.held = 0       # bytes of the buffers remembered (free or in use)
        self.reused = 0

    def take(self, n: int) -> T | None:
        """A buffer of length n that nobody but the pool holds (forgotten by the pool: `keep` it again), or None."""
        with self._lock:
            bufs = self._by_len.get(n)
            if not bufs:
                return None
            for bid in bufs:   # oldest first: the likeliest to be let go
                b = bufs[bid]
                if sys.getrefcount(b) == _REFS_IN_POOL and (self._usable is None or self._usable(b)):
                    break
            else:
                return None
            self._forget(bid)
            self.reused += 1
        return b

    def keep(self, b: T, n: int | None = None) -> None:
        """Remember buffer `b` to reuse once it is let go, when it fits under the limit; `n`: the length it is kept
        under and counted as (its capacity, where it holds fewer bytes than that; else its length)."""
        if n is None:
            n = len(b)
        if not self.limit or n > self.limit:
            return
        with self._lock:
            if self.held + n > self.limit:
                self._make_room(n)
            self._by_len.setdefault(n, {})[id(b)] = b
            self._order[id(b)] = n
            self.held += n

    def _make_room(self, need: int) -> None:
        """Forget buffers until `need` more bytes fit: those still in use first, then the oldest free ones."""
        for only_in_use in (True, False):
            over = self.held + need - self.limit
            victims = []
            for bid, n in self._order.items():   # oldest first, as far as needed
                if over <= 0:
                    break
                if only_in_use and sys.getrefcount(self._by_len[n][bid]) == _REFS_IN_POOL - 1:
                    continue   # free (held by the dict and the argument only): kept for the second pass
                victims.append(bid)
                over -= n
            for bid in victims:
                self._forget(bid)
            if over <= 0:
                return

    def _forget(self, bid: int) -> None:
        n = self._order.pop(bid)
        del self._by_len[n][bid]
        self.held -= n

    def clear(self) -> None:
        with self._lock:
            self._by_len.clear()
            self._order.clear()
            self.held = 0
