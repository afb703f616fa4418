"""Benchmark (标杆比对法): the default standard (every API not listed elsewhere, all npu_* fused ops included).

For each of small-value error ratio, RMSE, max and mean relative error: ratio = device metric / max(same-dtype
metric, floor[dtype]); error if the ratio exceeds its limit (2, 2, 10, 2). An inf/NaN device metric passes only if
the same-dtype run has the same inf/NaN (its ratio cell is then NaN). The error balance ratio is reported, not
judged. Needs the same-dtype run: without it the row is SKIP. The limits are tier L0's; a per-API tier
(selection.ApiJudging.tier, THRESHOLDS.benchmark_tiers) sets L1 (5, 1.5, 1.5 for max rel, mean rel, RMSE) or L2
(2, 1.2, 1.2); the small-value limit is 2 in every tier.
"""
from __future__ import annotations

import math

from gpu_server.judging.standards.registry import (
    Ratio,
    StandardInput,
    StandardResult,
    fmt,
    inf_nan_consistent,
    ratio_to_same,
    register_standard,
    share_bound_ratio,
    spread_reference,
)
from gpu_server.judging.standards.selection import BENCHMARK
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP, status_of

# (OutputMetrics attribute, ratio column, status column, key of THRESHOLDS.benchmark_ratio_limits)
_JUDGED = (
    ("small_value_error_ratio", "小值域错误比值", "小值域判定结果", "small_value"),
    ("rmse", "均方根误差比值", "均方根误差判定结果", "rmse"),
    ("max_rel_err", "相对误差最大值比值", "相对误差最大值判定结果", "max_rel"),
    ("mean_rel_err", "相对误差平均值比值", "相对误差平均值判定结果", "mean_rel"),
)
_REPORTED = ("error_balance", "误差均衡性比值")
_RATIO_COLUMNS = {limit_key: ratio_column for _, ratio_column, _, limit_key in _JUDGED}


# the reports show the mean relative error's ratio first, the limits of tier L0
@register_standard(BENCHMARK, "标杆比对法", "benchmark", device_error="mean_rel_err", ratios=tuple(
    Ratio(_RATIO_COLUMNS[k], THRESHOLDS.benchmark_ratio_limits[k]) for k in ("mean_rel", "rmse", "small_value",
                                                                             "max_rel")))
def benchmark(inp: StandardInput) -> StandardResult:
    if inp.same is None:
        return StandardResult(SKIP, messages=["the benchmark standard needs the same-dtype run, which is not "
                                              "available"])
    floor = inp.param("ratio_floor", THRESHOLDS.for_dtype(inp.dtype).ratio_floor)
    limits = THRESHOLDS.benchmark_tiers[inp.tier or THRESHOLDS.default_tier]
    result = StandardResult(PASS)
    for attr, ratio_column, status_column, limit_key in _JUDGED:
        value, same = getattr(inp.device, attr), getattr(inp.same, attr)
        consistent = inf_nan_consistent(value, same)
        if consistent is None:
            limit = inp.param(f"{limit_key}_ratio_limit", limits[limit_key])
            ratio = ratio_to_same(value, same, floor)   # msprobe's cell
            judged, basis = _spread_ratio(inp, attr, value, floor)
            ok = judged <= limit
            why = (f"ERROR: {ratio_column}超过阈值 ({fmt(judged)} > {limit} against {basis}; device {fmt(value)}, "
                   f"same-dtype {fmt(same)}, floor {fmt(floor)})")
            if ok and ratio > limit:
                result.messages.append(f"{ratio_column} {fmt(ratio)} > {limit} against the same-dtype run only; "
                                       f"{fmt(judged)} against {basis}: pass")
        else:
            ratio, ok = math.nan, consistent
            why = (f"ERROR: {ratio_column.removesuffix('比值')}inf或nan不一致 (device {fmt(value)}, same-dtype "
                   f"{fmt(same)})")
        result.cells[ratio_column] = ratio
        result.cells[status_column] = status_of(ok)
        if not ok:
            result.status = ERROR
            result.messages.append(why)
    attr, ratio_column = _REPORTED
    value, same = getattr(inp.device, attr), getattr(inp.same, attr)
    result.cells[ratio_column] = (math.nan if inf_nan_consistent(value, same) is not None
                                  else ratio_to_same(value, same, floor))
    return result


def _spread_ratio(inp: StandardInput, attr: str, value: float, floor: float) -> tuple[float, str]:
    """The ratio the verdict uses: against the largest metric of the spread members (docs/standards.md); the
    small-value error ratio (a share of few elements) by its confidence bounds."""
    members = inp.members()
    if attr == "small_value_error_ratio" and inp.device.counts and all(m.counts for m in members):
        c = inp.device.counts
        pairs = [(m.counts["small_bad"], m.counts["small"]) for m in members]
        return (share_bound_ratio(c["small_bad"], c["small"], pairs, floor),
                f"the spread of {len(members)} same-dtype runs (Wilson bounds)")
    values = [getattr(m, attr) for m in members]
    if any(v is not None and not math.isfinite(v) for v in values):
        return 0.0, "a same-dtype run with a non-finite metric"   # no reference a finite metric can exceed
    ref = spread_reference(values)
    return ratio_to_same(value, ref, floor), f"the spread of {len(members)} same-dtype runs (max {fmt(ref)})"
