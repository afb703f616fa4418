"""ULP error (ULP误差比对法): matrix products (matmul, mm, bmm, linear, addmm, ...).

ulp_err = |device - bench| / spacing of the device format at the bench's binade (eb = max(floor(log2|bench|),
min_eb), min_eb also where bench == 0). share = elements with ulp_err above 32 (float32) or 1 (float16,
bfloat16); ratio = device share / max(same-dtype share, floor[dtype]).
float32 passes if the mean ULP error < 64, or the share < 0.05, or the ratio <= 1; float16/bfloat16 pass if the
share < 0.001 or the ratio <= 1 (our fix, docs/standards.md: msprobe needed ratio < 1). An inf/NaN mean ULP error must
match the
same-dtype run's.
"""
from __future__ import annotations

import math
from dataclasses import replace

from gpu_server.judging.standards.registry import (
    Ratio,
    StandardInput,
    StandardResult,
    fmt,
    inf_nan_consistent,
    ratio_to_same,
    register_standard,
    share_bound_ratio,
    wilson,
)
from gpu_server.judging.standards.selection import ULP
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP

GROSS_ULP = 4.0   # max ULP error above this many times the spread's (or the threshold): no benefit of the bound
_MEAN, _SHARE, _RATIO, _STATUS = "ULP误差平均值", "ULP误差大于阈值占比", "ULP误差大于阈值占比比值", "ULP误差判定结果"


@register_standard(ULP, "ULP误差比对法", "ULP", ratios=(Ratio(_RATIO, THRESHOLDS.ulp_ratio_limit),),
                   device_error="ulp_mean")
def ulp_error(inp: StandardInput) -> StandardResult:
    base = THRESHOLDS.for_dtype(inp.dtype)
    mean_limit = inp.overrides.get("ulp_mean_limit", base.ulp_mean_limit)
    row = replace(base, ulp_threshold=inp.param("ulp_threshold", base.ulp_threshold),
                  ratio_floor=inp.param("ratio_floor", base.ratio_floor),
                  ulp_share_limit=inp.param("ulp_share_limit", base.ulp_share_limit),
                  ulp_mean_limit=None if mean_limit is None else float(mean_limit))
    mean, share = inp.device.ulp_mean, inp.device.ulp_over_threshold
    cells: dict[str, str | float] = {_MEAN: mean, _SHARE: share}

    def done(status: str, message: str = "") -> StandardResult:
        cells[_STATUS] = status
        return StandardResult(status, cells, [message] if message else [])

    ratio = None
    if inp.same is not None:
        if inf_nan_consistent(mean, inp.same.ulp_mean) is False:
            return done(ERROR, f"ERROR: ULP误差不满足标准 (mean ULP error {fmt(mean)}, same-dtype "
                               f"{fmt(inp.same.ulp_mean)}: inf或nan不一致)")
        ratio = ratio_to_same(share, inp.same.ulp_over_threshold, row.ratio_floor)
        cells[_RATIO] = ratio
    elif not math.isfinite(mean):
        return done(SKIP, f"mean ULP error {fmt(mean)}: the same-dtype run, which is not available, must show the same")
    if row.ulp_mean_limit is not None and mean < row.ulp_mean_limit:
        return done(PASS)
    if share < row.ulp_share_limit:
        return done(PASS)
    if ratio is not None and ratio <= THRESHOLDS.ulp_ratio_limit:
        return done(PASS)
    counts = inp.device.counts
    members = inp.members()
    # a few elements a few ULP out are within what a correct device may do; far out they are a fault
    gross = inp.device.ulp_max > GROSS_ULP * max([row.ulp_threshold] + [m.ulp_max for m in members
                                                                         if m.ulp_max is not None])
    if counts and not gross and wilson(counts["ulp_over"], counts["numel"], upper=False) < row.ulp_share_limit:
        return done(PASS, f"over-threshold share {fmt(share)}: its lower confidence bound is below "
                          f"{row.ulp_share_limit} (a share of few elements)")
    if ratio is not None and counts and not gross and all(m.counts for m in members):
        bound = share_bound_ratio(counts["ulp_over"], counts["numel"],
                                  [(m.counts["ulp_over"], m.counts["numel"]) for m in members], row.ratio_floor)
        if bound <= THRESHOLDS.ulp_ratio_limit:
            return done(PASS, f"ratio {fmt(ratio)} against the same-dtype run only; {fmt(bound)} <= "
                              f"{THRESHOLDS.ulp_ratio_limit} against the spread of {len(members)} same-dtype runs "
                              "(Wilson bounds)")
        ratio_msg = f"ratio {fmt(ratio)}, {fmt(bound)} against the spread (Wilson bounds)"
    else:
        ratio_msg = f"ratio {fmt(ratio)}" + (f" (max ULP error {fmt(inp.device.ulp_max)} is gross)" if gross else "")
    failed = f"over-threshold share {fmt(share)} >= {row.ulp_share_limit}"
    if row.ulp_mean_limit is not None:
        failed = f"mean ULP error {fmt(mean)} >= {row.ulp_mean_limit}, " + failed
    if ratio is None:
        return done(SKIP, f"ULP standard needs the same-dtype run, which is not available ({failed})")
    return done(ERROR, f"ERROR: ULP误差不满足标准 ({failed}, {ratio_msg} > {THRESHOLDS.ulp_ratio_limit})")
