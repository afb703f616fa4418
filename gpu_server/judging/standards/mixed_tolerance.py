"""Mixed tolerance (混合容差, Ascend's 2026 operator standards): the default for float8 outputs, selectable per API.

Element by element, |device - bench| <= atol + rtol * |bench| (bench: the upcast bench output, in float64
arithmetic); the standard passes when at least 99 % of the elements pass AND every element's error is at most
max(floor, 32 ULP of the bench in the device format) (ULP as the ULP standard's: 2^(eb - p), eb = max(floor(log2
|bench|), min_eb)). Constants per dtype: THRESHOLDS.mixed_tolerance (floor = atol: docs/standards.md says why).
Non-finite values (the bench taken in the device dtype, as everywhere): an element that is inf/NaN on either side
passes only when both are NaN or both the same infinity; any other disagreement is an error whatever the pass rate.
Needs the tensors (StandardInput.bench/.output): without them (the offline comparison of metric CSVs) SKIP.
"""
from __future__ import annotations

import math

import torch

from gpu_server.judging.standards.registry import Ratio, StandardInput, StandardResult, fmt, register_standard
from gpu_server.judging.standards.selection import MIXED_TOLERANCE
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP

RATE, MAX_RATIO, STATUS = "混合容差通过率", "混合容差最大误差比值", "混合容差判定结果"
MAX_RATIO_LIMIT = 1.0   # the largest error over its allowance max(floor, max_ulp ULP)


def mixed_counts(bench: torch.Tensor, device: torch.Tensor, atol: float, rtol: float, floor: float, max_ulp: float,
                 chunk: int | None = None) -> dict[str, float]:
    """numel, passed (elements within atol + rtol |bench|, agreeing inf/NaN included), nonfinite_bad (inf/NaN
    disagreements), max_ratio (largest error over its allowance max(floor, max_ulp ULP)), max_err (largest error,
    finite elements) and where_max (the bench value there)."""
    row = THRESHOLDS.for_dtype(device.dtype)
    scale = 2.0 ** -row.ulp_precision
    b_all, d_all = bench.detach().reshape(-1), device.detach().to(bench.device).reshape(-1)
    n = d_all.numel()
    chunk = chunk or THRESHOLDS.chunk_elements
    passed = bad = 0
    max_ratio, max_err, where = 0.0, 0.0, math.nan
    for start in range(0, n, chunk):
        b_src, d_src = b_all[start:start + chunk], d_all[start:start + chunk]
        b = b_src.to(torch.float64)
        d = (d_src.float() if d_src.element_size() == 1 else d_src).to(torch.float64)
        golden = b_src.to(device.dtype)
        golden = (golden.float() if golden.element_size() == 1 else golden).to(torch.float64)
        finite = torch.isfinite(d) & torch.isfinite(golden)
        agree = (torch.isnan(d) & torch.isnan(golden)) | (d == golden)
        bad += int(torch.count_nonzero(~finite & ~agree))
        err = torch.where(finite, (d - b).abs(), 0.0)
        ok = finite & (err <= atol + rtol * b.abs())
        passed += int(torch.count_nonzero(ok | (~finite & agree)))
        _, exponent = torch.frexp(torch.where(finite, b, 0.0))
        eb = torch.where(b == 0, row.ulp_min_exponent, exponent.double() - 1).clamp_min(row.ulp_min_exponent)
        allowed = torch.clamp_min(max_ulp * torch.exp2(eb) * scale, floor)
        ratio = err / allowed if floor > 0 else torch.where(err == 0, 0.0, err / allowed)
        if ratio.numel():
            i = int(torch.argmax(ratio))
            if float(ratio[i]) > max_ratio:
                max_ratio, max_err, where = float(ratio[i]), float(err[i]), float(b[i])
    return {"numel": n, "passed": passed, "nonfinite_bad": bad, "max_ratio": max_ratio, "max_err": max_err,
            "where_max": where}


@register_standard(MIXED_TOLERANCE, "混合容差比对法", "mixed tolerance",
                   ratios=(Ratio(RATE, THRESHOLDS.mixed_pass_rate), Ratio(MAX_RATIO, MAX_RATIO_LIMIT)))
def mixed_tolerance(inp: StandardInput) -> StandardResult:
    if inp.bench is None or inp.output is None or inp.dtype not in THRESHOLDS.mixed_tolerance:
        why = ("the mixed-tolerance standard needs the output tensors" if inp.bench is None or inp.output is None
               else f"{inp.dtype} has no mixed-tolerance constants")
        return StandardResult(SKIP, messages=[why])
    const = THRESHOLDS.mixed_tolerance[inp.dtype]
    atol, rtol = inp.param("atol", const.atol), inp.param("rtol", const.rtol)
    floor, max_ulp = inp.param("floor", const.floor), inp.param("max_ulp", THRESHOLDS.mixed_max_ulp)
    need = inp.param("pass_rate", THRESHOLDS.mixed_pass_rate)
    c = mixed_counts(inp.bench, inp.output, atol, rtol, floor, max_ulp)
    rate = c["passed"] / c["numel"] if c["numel"] else 1.0
    result = StandardResult(PASS, {RATE: rate, MAX_RATIO: c["max_ratio"]})
    if c["nonfinite_bad"]:
        result.status = ERROR
        result.messages.append(f"ERROR: 混合容差inf或nan不一致 ({c['nonfinite_bad']} inf/NaN values disagree with "
                               "the bench in the device's dtype: position, class or sign)")
    if rate < need:
        result.status = ERROR
        result.messages.append(f"ERROR: 混合容差通过率不达标 (pass rate {fmt(rate)} < {need}: "
                               f"{c['numel'] - c['passed']} of {c['numel']} elements with |device - bench| > "
                               f"{fmt(atol)} + {fmt(rtol)} |bench|)")
    if c["max_ratio"] > MAX_RATIO_LIMIT:
        result.status = ERROR
        result.messages.append(f"ERROR: 混合容差最大误差超过阈值 (error {fmt(c['max_err'])} at bench "
                               f"{fmt(c['where_max'])} is {fmt(c['max_ratio'])} times max({fmt(floor)}, "
                               f"{fmt(max_ulp)} ULP))")
    result.cells[STATUS] = result.status
    return result
