"""Two-way status of docs/standards.md (accuracy_checking_details `Status`). Pure, no I/O.

Statuses are msprobe's strings (gpu_server/statuses.py, which also aggregates them into an API's status).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from gpu_server.judging.metrics import Analysis, OutputMetrics, scalar_error_rate
from gpu_server.judging.output_kind import (
    NONE,
    OTHER,
    SCALAR,
    OutputPair,
    bit_identical,
    classify,
    comparable_member,
    type_differs,
)
from gpu_server.judging.standards.registry import fmt, wilson
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP, WARNING


@dataclass
class OutputComparison:
    metrics: OutputMetrics | None
    status: str  # "pass" | "Warning" | "error" | "SKIP"
    message: str


def compare_output(bench: Any, device: Any, spread: Iterable = ()) -> OutputComparison:
    """compare_pair of an output not sorted yet."""
    return compare_pair(classify(bench, device), spread)


def compare_pair(pair: OutputPair, spread: Iterable = ()) -> OutputComparison:
    """The two-way status of one output, sorted into its kind (gpu_server/judging/output_kind.py). `spread`: outputs of
    correct same-dtype runs (the host's first, then gpu_server.replay.spread's); an error or Warning that a correct run
    shows as well is pass (docs/standards.md, deviations)."""
    if pair.kind == NONE:
        return OutputComparison(None, SKIP, "Bench output is None, skip this test.")
    if pair.mismatched:
        return OutputComparison(None, ERROR, pair.reason)
    if pair.kind == SCALAR:
        return _compare_scalars(pair.bench, pair.device)
    if pair.kind == OTHER:
        return OutputComparison(None, ERROR, f"unexpected output type {type(pair.bench).__name__}")
    cmp = _compare_tensors(pair)
    # `spread` is lazy (gpu_server/spread.with_host): its stochastic-rounding runs are computed only when consumed
    if cmp.status in (ERROR, WARNING) and not _judge_finite_part(cmp, pair, spread):
        _forgive(cmp, pair, spread)
    return cmp


def _judge_finite_part(cmp: OutputComparison, pair: OutputPair, spread: Iterable) -> bool:
    """An output with inf/NaN where the device and the bench (in the device's dtype) agree on every non-finite
    position and sign (or saturate alike) is judged on its finite part: the elements finite on both sides, with the
    same rules (docs/standards.md, deviations: msprobe's NaN cosine made every such output an error). Returns False,
    changing nothing, when the rule does not apply (no non-finite values, or they disagree: that stays an error)."""
    counts = cmp.metrics.counts if cmp.metrics is not None else None
    if not counts or not counts.get("inf_nan") or counts.get("inf_nan_bad"):
        return False
    bench, device = pair.bench.detach(), pair.device.detach()
    if bench.dtype.is_complex or device.dtype.is_complex:
        return False
    golden = bench.to(device.dtype)
    keep = (torch.isfinite(device) & torch.isfinite(golden)).reshape(-1)
    both = int(counts["inf_nan"])
    members = [m.detach().to(device.device).reshape(-1)[keep] for m in spread if comparable_member(m, device)]
    finite = compare_pair(classify(bench.reshape(-1)[keep], device.reshape(-1)[keep]), members)
    status = PASS if finite.status == SKIP else finite.status
    cmp.status = status
    cmp.message = (f"{both} inf/NaN values in both the device and the bench output (the bench in "
                   f"{str(device.dtype).replace('torch.', '')}), at the same positions and signs; judged on the "
                   f"{int(keep.sum())} finite elements: {finite.message or status}")
    return True


def _compare_scalars(bench: Any, device: Any) -> OutputComparison:
    rate = scalar_error_rate(bench, device)
    metrics = OutputMetrics(binary_error_rate=rate)
    if rate == 0:
        return OutputComparison(metrics, PASS, "")
    if type(bench) is not type(device):
        return OutputComparison(metrics, ERROR, type_differs(bench, device))
    return OutputComparison(metrics, ERROR, f"bench {bench!r} != device {device!r}")


def _compare_tensors(pair: OutputPair) -> OutputComparison:
    result = pair.analysis()
    m = result.metrics
    if not result.is_float:
        if m.binary_error_rate == 0:
            return OutputComparison(m, PASS, "")
        differ = round(m.binary_error_rate * result.numel)
        return OutputComparison(m, ERROR, f"binary error rate {fmt(m.binary_error_rate)} ({differ} of "
                                          f"{result.numel} elements differ; {pair.device.dtype} must be identical)")
    return OutputComparison(m, *_float_status(result))


def _float_status(result: Analysis) -> tuple[str, str]:
    t, m, cos = THRESHOLDS, result.metrics, result.cosine
    dtype_name = str(result.device_dtype).replace("torch.", "")
    if not cos.passed:
        why = cos.note or f"cosine {fmt(cos.value)} <= {t.cosine_pass}"
        return ERROR, why
    if m.max_abs_err < t.max_abs_pass:
        return PASS, f"max abs error {fmt(m.max_abs_err)} < {t.max_abs_pass}"

    def share(name: str, value: float, bound: float, pass_value: float, op: str) -> str:
        outside = round((1 - value) * result.numel)
        return (f"{name} {fmt(value)} {op} {pass_value} ({dtype_name}; {outside} of {result.numel} elements with "
                f"relative error >= {bound})")

    if t.for_dtype(result.device_dtype).low_precision:
        if not m.hundredth > t.hundredth_pass:
            return ERROR, share("double-hundredth", m.hundredth, t.hundredth, t.hundredth_pass, "<=")
        if m.thousandth > t.thousandth_pass:
            return PASS, share("double-thousandth", m.thousandth, t.thousandth, t.thousandth_pass, ">")
        return WARNING, share("double-thousandth", m.thousandth, t.thousandth, t.thousandth_pass, "<=")
    if not m.thousandth > t.thousandth_pass:
        return ERROR, share("double-thousandth", m.thousandth, t.thousandth, t.thousandth_pass, "<=")
    if not m.ten_thousandth > t.ten_thousandth_pass:
        return WARNING, share("double-ten-thousandth", m.ten_thousandth, t.ten_thousandth, t.ten_thousandth_pass,
                              "<=")
    return PASS, share("double-ten-thousandth", m.ten_thousandth, t.ten_thousandth, t.ten_thousandth_pass, ">")


_SEVERITY = {PASS: 0, WARNING: 1, ERROR: 2}
_SHARES = ("hundredth", "thousandth", "ten_thousandth")   # the double-x counts (OutputMetrics.counts keys)


def _forgive(cmp: OutputComparison, pair: OutputPair, spread: Iterable) -> None:
    """Turn an error/Warning into pass when a correct same-dtype run gets the same status or worse and the device is
    not significantly further out: bit-identical to the host's run, or (cosine above the gate) for each double-x share
    the device's count of elements outside no more than the member's (lower vs upper Wilson bound). Only comparable
    outputs (no shape or dtype-kind mismatch) get here."""
    for i, member in enumerate(spread):
        if not comparable_member(member, pair.device):
            continue
        if i == 0 and bit_identical(member, pair.device):
            cmp.status, cmp.message = PASS, ("bit-identical to the same-dtype run on the bench device; against "
                                             f"the upcast bench: {cmp.message}")
            return
        if cmp.metrics.counts is None:
            continue
        ref = pair.member_analysis(member)
        ref_status, _ = _float_status(ref) if ref.is_float else (PASS, "")
        if _SEVERITY.get(ref_status, 0) < _SEVERITY[cmp.status]:
            continue
        d, r = cmp.metrics, ref.metrics
        if d.counts is None or r.counts is None:
            continue
        if d.counts.get("inf_nan_bad", 0) > r.counts.get("inf_nan_bad", 0):
            continue   # more inf/NaN disagreements than the correct run: further out, never forgiven
        n, m = d.counts["numel"], r.counts["numel"]
        ok = all(wilson(n - d.counts[key], n, upper=False) <= wilson(m - r.counts[key], m, upper=True)
                 for key in _SHARES)
        # a cosine at or below the gate is a disagreement in direction, not rounding: never forgiven (a random API
        # whose host run drew other numbers must not pass this way)
        ok = ok and (d.cosine is None or d.cosine > THRESHOLDS.cosine_pass)
        if ok:
            cmp.status, cmp.message = PASS, (f"a correct same-dtype run ({'host' if i == 0 else 'spread run'}) "
                                             f"gets {ref_status} too and the device is not further out; against the "
                                             f"upcast bench: {cmp.message}")
            return
