"""Sorting one compared output into its kind, once, for both reports (the two-way status, gpu_server/judging/verdict.py,
and
the precision standards, gpu_server/judging/standards/judging.py), in the spirit of torch/testing/_comparison.py's
pairs.

A pair (bench, device) is one of:
- NONE: no bench output (both reports SKIP);
- TYPE_MISMATCH: a tensor on one side only (an error in both reports);
- TENSOR_MISMATCH: two tensors that cannot be compared element by element, shape or dtype kind (an error in both);
- TENSORS: two comparable tensors;
- SCALAR: a Python value compared by equality (bool, int, float, complex, str, dtype, device, size);
- OTHER: any other value (the two-way status calls it unexpected, the standards compare it by equality).

The pair also caches the metrics of the bench against each same-dtype run (the spread members), so that the two
reports, which both judge against them, compute them once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_server.judging.bits import same_bits
from gpu_server.judging.metrics import Analysis, analyse, mismatch

NONE, TYPE_MISMATCH, TENSOR_MISMATCH, TENSORS, SCALAR, OTHER = (
    "none", "type mismatch", "tensor mismatch", "tensors", "scalar", "other")

# Python values compared by equality (str, dtype, device and size come along with the numbers).
SCALAR_TYPES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


@dataclass(eq=False)
class OutputPair:
    kind: str
    bench: Any
    device: Any
    reason: str = ""      # why the pair cannot be compared (the two mismatch kinds); "" otherwise
    _analysis: Analysis | None = field(default=None, repr=False)
    _members: dict[int, tuple[torch.Tensor, Analysis]] = field(default_factory=dict, repr=False)

    @property
    def mismatched(self) -> bool:
        return self.kind in (TYPE_MISMATCH, TENSOR_MISMATCH)

    def analysis(self) -> Analysis:
        """The device output against the bench (TENSORS only), computed once for both reports."""
        if self._analysis is None:
            self._analysis = analyse(self.bench, self.device)
        return self._analysis

    def member_analysis(self, member: torch.Tensor) -> Analysis:
        """The bench against a same-dtype run's output (a comparable member: see `comparable_member`), computed once
        per member however many reports ask."""
        cached = self._members.get(id(member))   # the member is kept with its result: its id stays unique
        if cached is None:
            cached = self._members[id(member)] = (member, analyse(self.bench, member))
        return cached[1]


def classify(bench: Any, device: Any) -> OutputPair:
    """Sort one output into its kind (see the module docstring)."""
    if bench is None:
        return OutputPair(NONE, bench, device)
    bench_tensor, device_tensor = isinstance(bench, torch.Tensor), isinstance(device, torch.Tensor)
    if bench_tensor != device_tensor:
        return OutputPair(TYPE_MISMATCH, bench, device, type_differs(bench, device))
    if bench_tensor:
        reason = mismatch(bench, device)
        return OutputPair(TENSOR_MISMATCH, bench, device, reason) if reason else OutputPair(TENSORS, bench, device)
    return OutputPair(SCALAR if isinstance(bench, SCALAR_TYPES) else OTHER, bench, device)


def type_differs(bench: Any, device: Any) -> str:
    return f"output type differs: bench {type(bench).__name__}, device {type(device).__name__}"


def comparable_member(member: Any, device: torch.Tensor) -> bool:
    """A same-dtype run's output can stand for a correct device: a tensor of the device's shape and dtype."""
    return isinstance(member, torch.Tensor) and not mismatch(member, device) and member.dtype == device.dtype


def bit_identical(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits (NaN payloads and signed zeros included); `a` taken to `b`'s device."""
    if a is None or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return same_bits(a.detach().to(b.device), b)
