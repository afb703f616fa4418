"""The precision standards' verdict on one output (api_precision_compare `比对结果`, docs/standards.md).

`judge_pair(api_name, pair, same)` takes an output already sorted into its kind (gpu_server/judging/output_kind.py,
shared
with the two-way status), selects a standard (selection.py) from the output dtype and the API name, computes the
same-dtype run's metrics against the bench (gpu_server.judging.metrics) and lets the registered standard (binary.py,
absolute.py, ulp.py, thousandth.py, benchmark.py, mixed_tolerance.py, quantisation.py) decide, honouring a per-API
configuration (selection.configure: standard, tier, thresholds). `judge(api_name, bench, device, same)` sorts the output
itself. This module sits above metrics (metrics reads the thresholds of this package): the package's __init__ does
not import it, so there is no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch

from gpu_server.columns import BLANK
from gpu_server.judging.metrics import OutputMetrics, analyse_with, dtype_kind, mismatch, scalar_error_rate
from gpu_server.judging.output_kind import (
    NONE,
    OTHER,
    SCALAR,
    TYPE_MISMATCH,
    OutputPair,
    bit_identical,
    classify,
    comparable_member,
)
from gpu_server.judging.standards.registry import STANDARD_REGISTRY, StandardInput, StandardResult
from gpu_server.judging.standards.selection import BINARY, METRIC_PARAMETERS, ApiJudging, api_judging, select_standard
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.statuses import ERROR, PASS, SKIP


@dataclass
class PrecisionJudgement:
    cells: dict[str, str | float] = field(default_factory=dict)  # api_precision_compare_details cells by title
    status: str = SKIP                                              # 比对结果: "pass" | "error" | "SKIP"
    algorithm: str = BLANK                                          # 比对算法
    message: str = ""


def judge(api_name: str, bench: Any, device: Any, same: Any = None, spread: Iterable = (),
          category: str | None = None) -> PrecisionJudgement:
    """judge_pair of an output not sorted yet."""
    return judge_pair(api_name, classify(bench, device), same, spread, category=category)


def judge_pair(api_name: str, pair: OutputPair, same: Any = None, spread: Iterable = (),
               category: str | None = None) -> PrecisionJudgement:
    """The verdict of one output. pair: upcast bench output and device output; same: the same-dtype run's output on
    the trusted host (None when it could not run). The device output's metrics against the bench come from the
    pair, computed once for both reports. `spread`: outputs of other correct same-dtype runs (gpu_server.replay.spread);
    the ratio tests judge against the largest of their metrics and the host run's (docs/standards.md).
    `category` ("Functional"): with `api_name` the key of a per-API configuration (selection.configure); without
    it `api_name` itself is looked up (then it must be "Category.api" to match)."""
    if pair.kind == NONE:
        return PrecisionJudgement(message="no bench output")
    if pair.kind == TYPE_MISMATCH:
        return _error(BINARY, pair.reason)
    if pair.kind in (SCALAR, OTHER):     # a Python value: binary consistency
        rate = scalar_error_rate(pair.bench, pair.device)
        return _finish(BINARY, STANDARD_REGISTRY[BINARY].judge(StandardInput(
            None, OutputMetrics(binary_error_rate=rate), None)), "")

    device = pair.device
    judging = api_judging(api_name, category)
    key = select_standard(api_name, device.dtype, judging)
    if pair.mismatched:
        return _error(key, pair.reason)
    if dtype_kind(device.dtype) != "integer/bool" and device.dtype not in THRESHOLDS.judged_dtypes:
        return PrecisionJudgement(status=SKIP, algorithm=STANDARD_REGISTRY[key].algorithm,
                                  message=f"{device.dtype} is not supported by the precision standard")

    overrides, row = _overrides(judging, key, device.dtype)
    notes = []
    same_metrics = None
    if same is not None:
        reason = mismatch(same, device) if isinstance(same, torch.Tensor) else f"a {type(same).__name__}"
        if reason:
            notes.append(f"same-dtype run output ignored ({reason.replace('bench', 'same-dtype')})")
        else:
            same_metrics = (pair.member_analysis(same) if row is None else analyse_with(pair.bench, same, row)).metrics
    device_metrics = (pair.analysis() if row is None else analyse_with(pair.bench, device, row)).metrics
    standard = STANDARD_REGISTRY[key]
    extra = dict(bench=pair.bench, output=device, overrides=overrides, tier=judging.tier if judging else None)
    result = standard.judge(StandardInput(device.dtype, device_metrics, same_metrics, **extra))
    if result.status == ERROR and same_metrics is not None:
        # more spread members only make the verdict more lenient: they are computed only for a row that fails
        spread_metrics = tuple((pair.member_analysis(m) if row is None else analyse_with(pair.bench, m, row)).metrics
                               for m in spread if comparable_member(m, device))
        if spread_metrics:
            result = standard.judge(StandardInput(device.dtype, device_metrics, same_metrics, spread_metrics,
                                                  **extra))
    if result.status != PASS and bit_identical(same, device):
        result.status = PASS
        notes.append("pass: the device output is bit-identical to the same-dtype run")
    return _finish(key, result, "; ".join(notes))


def _overrides(judging: ApiJudging | None, key: str, dtype: torch.dtype) -> tuple[dict, Any]:
    """The configured thresholds of this dtype, and the metrics' parameter row when they change one of its
    parameters (METRIC_PARAMETERS: the metrics are then computed again with it), else None."""
    if judging is None or not judging.thresholds:
        return {}, None
    overrides = dict(judging.thresholds.get(str(dtype).replace("torch.", ""), {}))
    changed = {name: overrides[name] for name in METRIC_PARAMETERS.get(key, ()) if name in overrides}
    if not changed or not dtype.is_floating_point:
        return overrides, None
    return overrides, replace(THRESHOLDS.for_dtype(dtype), **changed)


def _error(key: str, message: str) -> PrecisionJudgement:
    return PrecisionJudgement(status=ERROR, algorithm=STANDARD_REGISTRY[key].algorithm, message=message)


def _finish(key: str, result: StandardResult, note: str) -> PrecisionJudgement:
    message = "; ".join([m for m in result.messages if m] + ([note] if note else []))
    cells = {k: v for k, v in result.cells.items() if v is not None}
    return PrecisionJudgement(cells, result.status, STANDARD_REGISTRY[key].algorithm, message)
