"""A set of sequence numbers that stays small: records of a stream arrive nearly in order, so the set is kept as
sorted, merged [first, last] ranges (one range for a stream without gaps), not one entry per record. Used for the
duplicate check and the spool's record of what is completely reported."""
from __future__ import annotations

import bisect
from typing import Iterable, Iterator


class SeqSet:
    __slots__ = ("_starts", "_ends")

    def __init__(self, seqs: Iterable[int] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for s in seqs:
            self.add(s)

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and seq <= self._ends[i]

    def add(self, seq: int) -> bool:
        """Add `seq`; True if it was not there."""
        seq = int(seq)
        i = bisect.bisect_right(self._starts, seq) - 1
        if i >= 0 and seq <= self._ends[i]:
            return False
        joins_left = i >= 0 and self._ends[i] == seq - 1
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == seq + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = seq
        elif joins_right:
            self._starts[i + 1] = seq
        else:
            self._starts.insert(i + 1, seq)
            self._ends.insert(i + 1, seq)
        return True

    def add_range(self, first: int, last: int) -> None:
        first, last = int(first), int(last)
        if first > last:
            return
        if not self._starts or first > self._ends[-1] + 1:   # the common case: ranges loaded in order
            self._starts.append(first)
            self._ends.append(last)
            return
        for s in range(first, last + 1):
            self.add(s)

    def update(self, seqs: Iterable[int]) -> None:
        for s in seqs:
            self.add(s)

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self._starts, self._ends)]

    def __len__(self) -> int:
        return sum(b - a + 1 for a, b in zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._starts, self._ends):
            yield from range(a, b + 1)

    def __bool__(self) -> bool:
        return bool(self._starts)
