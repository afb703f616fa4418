"""Double-thousandth (双千指标法): convolutions (conv1d, conv2d).

Passes iff the share of elements with relative error < 0.001 is >= 0.999 (msprobe's >=; the two-way status of
SPEC §6.2 uses a strict >).
"""
from __future__ import annotations

from gpu_server.standards.registry import StandardInput, StandardResult, fmt, register_standard, status_of
from gpu_server.standards.selection import THOUSANDTH
from gpu_server.standards.thresholds import THRESHOLDS


@register_standard(THOUSANDTH, "双千指标法")
def double_thousandth(inp: StandardInput) -> StandardResult:
    share = inp.device.thousandth
    limit = THRESHOLDS.thousandth_standard_pass
    ok = share >= limit
    status = status_of(ok)
    messages = [] if ok else [f"ERROR: 双千指标不达标 (double-thousandth {fmt(share)} < {limit})"]
    return StandardResult(status, {"双千指标": share, "双千指标判定结果": status}, messages)
