"""Absolute threshold (绝对阈值法): elementwise arithmetic (add, sub, mul, div, reciprocal, rsqrt, square, ...).

Three error rates of the device output against the bench, all of which must be 0 (docs/standards.md):
inf/nan error rate (inf/nan elements whose saturated values differ by more than rtol relative; both NaN passes;
a finite value against an infinite bench fails), relative error rate (normal elements with rel_err > rtol) and
absolute error rate (small elements with abs_err > small_atol).
"""
from __future__ import annotations

from gpu_server.judging.standards.registry import Ratio, StandardInput, StandardResult, fmt, register_standard
from gpu_server.judging.standards.selection import ABSOLUTE
from gpu_server.statuses import ERROR, PASS, status_of

# (OutputMetrics attribute, value column, status column)
_RATES = (
    ("inf_nan_error_rate", "inf/nan错误率", "inf/nan判定结果"),
    ("rel_err_rate", "相对误差错误率", "相对误差判定结果"),
    ("abs_err_rate", "绝对误差错误率", "绝对误差判定结果"),
)


# every rate must be 0 (no limit line); the reports show the relative and absolute error rates first
@register_standard(ABSOLUTE, "绝对阈值法", "absolute threshold", device_error="max_rel_err",
                   ratios=tuple(Ratio(column, 0.0) for _, column, _ in (_RATES[1], _RATES[2], _RATES[0])))
def absolute_threshold(inp: StandardInput) -> StandardResult:
    result = StandardResult(PASS)
    for attr, column, status_column in _RATES:
        rate = getattr(inp.device, attr)
        ok = rate == 0
        result.cells[column] = rate
        result.cells[status_column] = status_of(ok)
        if not ok:
            result.status = ERROR
            result.messages.append(f"ERROR: {column}超过阈值 ({fmt(rate)} > 0)")
    return result
