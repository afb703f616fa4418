"""Precision standards of SPEC §6.3 (api_precision_compare `比对结果`): pure functions, no I/O.

`judge(api_name, bench, device, same)` selects a standard (selection.py) from the output dtype and the API name,
computes the device output's metrics and the same-dtype run's metrics against the bench (gpu_server.metrics) and
lets the registered standard (binary.py, absolute.py, ulp.py, thousandth.py, benchmark.py) decide. Every threshold
is in thresholds.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from gpu_server.columns import BLANK
from gpu_server.standards import absolute, benchmark, binary, thousandth, ulp  # noqa: F401  (they register)
from gpu_server.standards.registry import (
    ERROR,
    PASS,
    SKIP,
    STANDARD_REGISTRY,
    StandardInput,
    StandardResult,
    register_standard,
)
from gpu_server.standards.selection import BINARY, canonical_name, select_standard
from gpu_server.standards.thresholds import THRESHOLDS

if TYPE_CHECKING:
    from gpu_server.metrics import OutputMetrics

__all__ = ["PrecisionJudgement", "judge", "bit_identical", "select_standard", "canonical_name", "register_standard",
           "STANDARD_REGISTRY", "THRESHOLDS"]


@dataclass
class PrecisionJudgement:
    cells: dict[str, str | float] = field(default_factory=dict)  # api_precision_compare_details cells by title
    status: str = SKIP                                              # 比对结果: "pass" | "error" | "SKIP"
    algorithm: str = BLANK                                          # 比对算法
    message: str = ""


def bit_identical(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits (NaN payloads and signed zeros included)."""
    if a is None or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.detach().to(b.device).reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def judge(api_name: str, bench: Any, device: Any, same: Any = None,
          device_metrics: OutputMetrics | None = None, spread: Iterable = ()) -> PrecisionJudgement:
    """SPEC §6.3 verdict of one output. bench: upcast bench output; device: device output; same: the same-dtype
    run's output on the trusted host (None when it could not run). `device_metrics`: the device output's metrics
    against the bench when the caller has them already (the two-way status computed them), so they are not
    computed twice. `spread`: outputs of other correct same-dtype runs (gpu_server.spread); the ratio tests judge
    against the largest of their metrics and the host run's (docs/standards.md)."""
    from gpu_server.metrics import dtype_kind, mismatch, output_metrics, scalar_error_rate  # (import cycle)

    if bench is None:
        return PrecisionJudgement(message="no bench output")
    if not (isinstance(bench, torch.Tensor) and isinstance(device, torch.Tensor)):
        if isinstance(bench, torch.Tensor) or isinstance(device, torch.Tensor):
            return _error(BINARY, f"output type differs: bench {type(bench).__name__}, device "
                                  f"{type(device).__name__}")
        rate = scalar_error_rate(bench, device)
        return _finish(BINARY, STANDARD_REGISTRY[BINARY].judge(_scalar_input(rate)), "")

    key = select_standard(api_name, device.dtype)
    reason = mismatch(bench, device)
    if reason:
        return _error(key, reason)
    if dtype_kind(device.dtype) != "integer/bool" and device.dtype not in THRESHOLDS.judged_dtypes:
        return PrecisionJudgement(status=SKIP, algorithm=STANDARD_REGISTRY[key].algorithm,
                                  message=f"{device.dtype} is not supported by the precision standard")

    notes = []
    same_metrics = None
    if same is not None:
        reason = mismatch(same, device) if isinstance(same, torch.Tensor) else f"a {type(same).__name__}"
        if reason:
            notes.append(f"same-dtype run output ignored ({reason.replace('bench', 'same-dtype')})")
        else:
            same_metrics = output_metrics(bench, same)
    if device_metrics is None or device_metrics.counts is None:
        device_metrics = output_metrics(bench, device)
    standard = STANDARD_REGISTRY[key]
    result = standard.judge(StandardInput(device.dtype, device_metrics, same_metrics))
    if result.status == ERROR and same_metrics is not None:
        # more spread members only make the verdict more lenient: they are computed only for a row that fails
        spread_metrics = tuple(output_metrics(bench, m) for m in spread if isinstance(m, torch.Tensor)
                               and not mismatch(m, device) and m.dtype == device.dtype)
        if spread_metrics:
            result = standard.judge(StandardInput(device.dtype, device_metrics, same_metrics, spread_metrics))
    if result.status != PASS and bit_identical(same, device):
        result.status = PASS
        notes.append("pass: the device output is bit-identical to the same-dtype run")
    return _finish(key, result, "; ".join(notes))


def _scalar_input(rate: float) -> StandardInput:
    from gpu_server.metrics import OutputMetrics

    return StandardInput(None, OutputMetrics(binary_error_rate=rate), None)


def _error(key: str, message: str) -> PrecisionJudgement:
    return PrecisionJudgement(status=ERROR, algorithm=STANDARD_REGISTRY[key].algorithm, message=message)


def _finish(key: str, result: StandardResult, note: str) -> PrecisionJudgement:
    message = "; ".join([m for m in result.messages if m] + ([note] if note else []))
    cells = {k: v for k, v in result.cells.items() if v is not None}
    return PrecisionJudgement(cells, result.status, STANDARD_REGISTRY[key].algorithm, message)

