"""ULP error (ULP误差比对法): matrix products (matmul, mm, bmm, linear, addmm, ...).

ulp_err = |device - bench| / spacing of the device format at the bench's binade (eb = max(floor(log2|bench|),
min_eb), min_eb also where bench == 0). share = elements with ulp_err above 32 (float32) or 1 (float16,
bfloat16); ratio = device share / max(same-dtype share, floor[dtype]).
float32 passes if the mean ULP error < 64, or the share < 0.05, or the ratio <= 1; float16/bfloat16 pass if the
share < 0.001 or the ratio <= 1 (SPEC fix: msprobe needed ratio < 1). An inf/NaN mean ULP error must match the
same-dtype run's.
"""
from __future__ import annotations

import math

from gpu_server.standards.registry import (
    ERROR,
    PASS,
    SKIP,
    StandardInput,
    StandardResult,
    fmt,
    inf_nan_consistent,
    ratio_to_same,
    register_standard,
)
from gpu_server.standards.selection import ULP
from gpu_server.standards.thresholds import THRESHOLDS

_MEAN, _SHARE, _RATIO, _STATUS = "ULP误差平均值", "ULP误差大于阈值占比", "ULP误差大于阈值占比比值", "ULP误差判定结果"


@register_standard(ULP, "ULP误差比对法")
def ulp_error(inp: StandardInput) -> StandardResult:
    row = THRESHOLDS.for_dtype(inp.dtype)
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
    failed = f"over-threshold share {fmt(share)} >= {row.ulp_share_limit}"
    if row.ulp_mean_limit is not None:
        failed = f"mean ULP error {fmt(mean)} >= {row.ulp_mean_limit}, " + failed
    if ratio is None:
        return done(SKIP, f"ULP standard needs the same-dtype run, which is not available ({failed})")
    return done(ERROR, f"ERROR: ULP误差不满足标准 ({failed}, ratio {fmt(ratio)} > {THRESHOLDS.ulp_ratio_limit})")
