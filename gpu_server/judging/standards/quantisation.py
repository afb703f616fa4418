"""Quantisation (量化): integer outputs of a float-input API (float in, integer out), msprobe's rule.

Element by element |device - bench| <= 1 (THRESHOLDS.quantisation_max_diff, per-API threshold `max_diff`): one
step of rounding either way is what two correct quantisers may differ by. Selected per API only (selection.configure:
ApiJudging(standard="quantisation")); on a float output the same rule applies to the values (NaN against NaN and the
same infinity pass, any other non-finite difference fails).
"""
from __future__ import annotations

import torch

from gpu_server.judging.standards.registry import Ratio, StandardInput, StandardResult, fmt, register_standard
from gpu_server.judging.standards.selection import QUANTISATION
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP

MAX_DIFF, STATUS = "量化误差最大值", "量化误差判定结果"


@register_standard(QUANTISATION, "量化比对法", "quantisation",
                   ratios=(Ratio(MAX_DIFF, THRESHOLDS.quantisation_max_diff),))
def quantisation(inp: StandardInput) -> StandardResult:
    if not isinstance(inp.bench, torch.Tensor) or not isinstance(inp.output, torch.Tensor):
        return StandardResult(SKIP, messages=["the quantisation standard needs the output tensors"])
    limit = inp.param("max_diff", THRESHOLDS.quantisation_max_diff)
    b = _wide(inp.bench.detach()).reshape(-1)
    d = _wide(inp.output.detach().to(inp.bench.device)).reshape(-1)
    n = d.numel()
    if n == 0:
        worst, bad = 0.0, 0
    else:
        same = (torch.isnan(b) & torch.isnan(d)) | (b == d)
        diff = torch.where(same, 0.0, (d - b).abs())
        diff = torch.where(torch.isnan(diff), torch.inf, diff)
        worst, bad = float(diff.max()), int(torch.count_nonzero(diff > limit))
    ok = bad == 0
    result = StandardResult(PASS if ok else ERROR, {MAX_DIFF: worst, STATUS: PASS if ok else ERROR})
    if not ok:
        result.messages.append(f"ERROR: 量化误差超过阈值 ({bad} of {n} elements with |device - bench| > "
                               f"{fmt(limit)}; max {fmt(worst)})")
    return result


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64 values (uint64 beyond 2^53 rounds: a difference of one step there is not representable anyway)."""
    if t.dtype == torch.bool:
        t = t.to(torch.int64)
    if t.is_floating_point() and t.element_size() == 1:
        t = t.float()
    return t.to(torch.float64)
