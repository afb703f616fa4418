"""Binary consistency (二进制一致法): the device output must equal the bench element for element.

Chosen for integer/bool outputs and for the exact operations docs/standards.md lists (abs, floor, gather, relu, ...).
Passes iff the binary error rate (share of elements with device != bench; both NaN counts as equal) is 0.
"""
from __future__ import annotations

from gpu_server.judging.standards.registry import Ratio, StandardInput, StandardResult, fmt, register_standard
from gpu_server.judging.standards.selection import BINARY
from gpu_server.statuses import status_of

RATE, STATUS = "二进制一致错误率", "二进制一致错误率判定结果"


@register_standard(BINARY, "二进制一致法", "binary consistency", ratios=(Ratio(RATE, 0.0),))
def binary_consistency(inp: StandardInput) -> StandardResult:
    rate = inp.device.binary_error_rate
    ok = rate == 0
    status = status_of(ok)
    messages = [] if ok else [f"ERROR: 二进制一致错误率超过阈值 (binary error rate {fmt(rate)} > 0)"]
    return StandardResult(status, {RATE: rate, STATUS: status}, messages)
