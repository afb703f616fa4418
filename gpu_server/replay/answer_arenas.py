"""The replay worker's answer arenas, on both sides: the server reads an answer's tensors in place (docs/design.md
§6.8).

An answer's tensors (the bench and same-dtype outputs, float64 for the bench: 7.2 GB over the 660 records of
`bench/server.py`'s mid transformer) used to be copied out of the worker's one answer arena so that the worker could
write its next answer there. Now the worker keeps a few arenas (`AnswerArenas`) and writes each answer into one the
server does not hold; the server (`AnswerMaps`) reads the tensors as views of that arena and holds it until the last
of them is gone (a `weakref.finalize` on the array the views share), then names it free in its next request.

* The worker never writes an arena the server holds: it marks each arena it answered in as held (`given`) until a
  request names it free; it makes a new arena when none is free.
* The server holds at most `HOLD` arenas. An answer that comes while it holds that many (tensors kept alive longer
  than their job, by whatever keeps them) is copied out as before and its arena named free at once, so the worker
  never needs more than `HOLD + 1` arenas.
* An arena that grows gets a new name (sandbox_wire.Arena); the worker names the old one `gone` in that answer and
  the server unmaps it (once no view of it is left).
* The server maps the arenas read-write: a view the checker writes in place stays the server's business (the worker
  overwrites the arena only once it is free), as a copy was. A worker that wrote an arena the server holds could
  change the numbers of an answer it has already given, which it could give wrong in the first place; every offset
  and size is checked against the arena before any view is made (sandbox_wire.read_leaves).
* A replaced worker starts from out-0 again: `AnswerMaps.close` forgets every mapping, and finalizers of views of the
  old worker's arenas no longer name anything free (an epoch).
"""
from __future__ import annotations

import itertools
import mmap
import threading
import weakref
from typing import Any

import numpy

from gpu_server.replay.sandbox_wire import Arena, check_arena_name, close_map, map_arena

HOLD = 2   # arenas the server holds at most; the worker keeps at most HOLD + 1


class AnswerArenas:
    """The worker's side: `reserve` an arena for the next answer (its `name` and `size` are then the answer's),
    `given` once the answer names it, `release` what a request names free, `take_gone` the names of arenas that
    grew (unlinked) for the answer to name."""

    def __init__(self, folder: str, prefix: str = "out"):
        self.folder, self.prefix = folder, prefix
        self._names = itertools.count()
        self._free: list[Arena] = []
        self._held: dict[str, Arena] = {}
        self._current: Arena | None = None
        self._gone: list[str] = []
        self.name = ""
        self.size = 0

    def reserve(self, nbytes: int) -> memoryview:
        """A writable view of at least `nbytes` in a free arena (the smallest that fits, else the largest grown,
        else a new one)."""
        fits = [a for a in self._free if a.size >= nbytes]
        if fits:
            arena = min(fits, key=lambda a: a.size)
        elif self._free:
            arena = max(self._free, key=lambda a: a.size)
        else:
            arena = Arena(self.folder, self.prefix, self._names)
            self._free.append(arena)
        old = arena.name if arena.is_open() else ""   # (one closed by ArenaFull was named gone then)
        try:
            view = arena.reserve(nbytes)
        finally:   # grown (a new name), or closed because the folder is full (ArenaFull): the old file is gone
            if old and (arena.name != old or not arena.is_open()):
                self._gone.append(old)
        self._current, self.name, self.size = arena, arena.name, arena.size
        return view

    def given(self, name: str) -> None:
        """The answer just written names `name`: the server may hold it from now on."""
        arena = self._current
        if arena is not None and arena.name == name and arena in self._free:
            self._free.remove(arena)
            self._held[name] = arena

    def release(self, names: Any) -> None:
        """A request named these arenas free (anything else in the list is ignored)."""
        if not isinstance(names, list):
            return
        for name in names:
            arena = self._held.pop(name, None) if isinstance(name, str) else None
            if arena is not None:
                self._free.append(arena)

    def take_gone(self) -> list[str]:
        gone, self._gone = self._gone, []
        return gone

    def close(self) -> None:
        for arena in [*self._free, *self._held.values()]:
            arena.close()
        self._free.clear()
        self._held.clear()


class AnswerMaps:
    """The server's side: `open` maps an answer's arena and says whether its tensors may be read in place (then the
    arena is held until the array returned, and every view of it, is gone); `done` gives back an arena read by
    copy; `take_free` lists what to name free in the next request; `forget` unmaps arenas the worker let go."""

    def __init__(self, folder: str, prefix: str = "out", hold: int = HOLD):
        self.folder, self.prefix, self.hold = folder, prefix, hold
        self._maps: dict[str, mmap.mmap | None] = {}
        self._live: set[str] = set()
        self._free: list[str] = []
        self._epoch = 0
        # finalizers run in whichever thread drops the last view, the collector's included: while this thread holds
        # the lock too (an allocation under it may start a collection), hence re-entrant
        self._lock = threading.RLock()
        self.in_place = self.copied = 0

    def open(self, name: Any) -> tuple[Any, bool]:
        """(the arena as a buffer, whether to read it in place)."""
        check_arena_name(name, self.prefix)
        if name not in self._maps:
            self._maps[name] = map_arena(self.folder, name, writable=True)
        m = self._maps[name]
        if m is None:
            return memoryview(b""), False
        with self._lock:
            in_place = len(self._live) < self.hold and name not in self._live
            if in_place:
                self._live.add(name)
        if not in_place:
            self.copied += 1
            return memoryview(m), False
        self.in_place += 1
        base = numpy.frombuffer(m, dtype=numpy.uint8)   # a new array per answer: the one object its views share
        weakref.finalize(base, self._unused, self._epoch, name)
        return base, True

    def _unused(self, epoch: int, name: str) -> None:
        with self._lock:
            if epoch == self._epoch and name in self._live:
                self._live.discard(name)
                self._free.append(name)

    def done(self, name: str) -> None:
        """An answer read by copy: its arena is free again."""
        with self._lock:
            if name not in self._live:
                self._free.append(name)

    def take_free(self) -> list[str]:
        with self._lock:
            free, self._free = self._free, []
        return free

    def forget(self, names: Any) -> None:
        """Unmap the arenas the worker removed (a mapping still viewed goes when its last view does)."""
        for name in names if isinstance(names, list) else ():
            m = self._maps.pop(name, None) if isinstance(name, str) else None
            close_map(m)

    def close(self) -> None:
        """Forget every arena (the worker is gone or replaced); views still alive keep their mappings."""
        with self._lock:
            self._epoch += 1
            self._live.clear()
            self._free.clear()
        for m in self._maps.values():
            close_map(m)
        self._maps.clear()

