"""Double-thousandth (双千指标法): convolutions (conv1d, conv2d).

Passes iff the share of elements with relative error < 0.001 is >= 0.999 (msprobe's >=; the two-way status of
docs/standards.md uses a strict >), or (docs/standards.md, the spread) when the device's share of elements outside is
not
significantly above a correct same-dtype run's (lower vs upper Wilson bound): bfloat16 rounding alone puts about
half of the elements outside.
"""
from __future__ import annotations

from gpu_server.judging.standards.registry import Ratio, StandardInput, StandardResult, fmt, register_standard, wilson
from gpu_server.judging.standards.selection import THOUSANDTH
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import status_of

GROSS = 4.0
SHARE, STATUS = "双千指标", "双千指标判定结果"


@register_standard(THOUSANDTH, "双千指标法", "double-thousandth",
                   ratios=(Ratio(SHARE, THRESHOLDS.thousandth_standard_pass),))
def double_thousandth(inp: StandardInput) -> StandardResult:
    share = inp.device.thousandth
    limit = inp.param("pass_share", THRESHOLDS.thousandth_standard_pass)
    ok = share >= limit
    messages = []
    c = inp.device.counts
    members = [m for m in inp.members() if m.counts]
    # a few elements far out are a fault whatever their share: the device's max relative error must stay within
    # GROSS times the spread's
    gross = members and inp.device.max_rel_err > GROSS * max(m.max_rel_err or 0.0 for m in members)
    # inf/NaN where the bench has none (or other ones), more than a correct run has, fail whatever the share: the
    # maximum relative error above skips non-finite elements (docs/standards.md, non-finite values)
    bad = c.get("inf_nan_bad", 0) if c else 0
    if bad > max((m.counts.get("inf_nan_bad", 0) for m in members), default=0):
        ok, gross = False, True
        messages.append(f"{bad} inf/NaN values disagree with the bench (in the device's dtype)")
    if not ok and c and members and not gross:
        # the spread rule (docs/standards.md): not significantly more elements outside than a correct run has
        outside = wilson(c["numel"] - c["thousandth"], c["numel"], upper=False)
        spread = max(wilson(m.counts["numel"] - m.counts["thousandth"], m.counts["numel"], upper=True)
                     for m in members)
        if outside <= spread:
            ok = True
            messages.append(f"double-thousandth {fmt(share)} < {limit}, but a correct same-dtype run has as many "
                            f"elements outside (Wilson bounds {fmt(outside)} <= {fmt(spread)}): pass")
    status = status_of(ok)
    if not ok:
        messages.append(f"ERROR: 双千指标不达标 (double-thousandth {fmt(share)} < {limit})")
    return StandardResult(status, {SHARE: share, STATUS: status}, messages)
